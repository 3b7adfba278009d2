# ruff: noqa  (a scratch script of the footing check, kept as run: raw evidence, not project code)
"""Scratch: TRL's generation, sampled: HF generate() with the GenerationConfig TRL builds (temperature 1, top_k 0,
top_p 1, repetition_penalty 1, eos [2], pad 2), prompts left-padded to the longest of the 8 tasks (TRL's batch),
under bf16 autocast over fp32 weights (accelerate's wrap of forward under GRPOConfig(bf16=True)). Per task one
batch of --samples; rows appended to a jsonl as they come (a stopped run keeps what it has)."""

import asyncio
import json
import sys
import time

sys.path.insert(0, "/tmp/lvt-footing")
import torch
from footing import setup
from transformers import AutoModelForCausalLM, GenerationConfig

torch.set_num_threads(2)
mode, samples = sys.argv[1], int(sys.argv[2])
config, model_path, tok, tasks, prompt_ids, score = setup(8)
model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
gc = GenerationConfig(
    max_new_tokens=128,
    do_sample=True,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    repetition_penalty=1.0,
    pad_token_id=2,
    bos_token_id=1,
    eos_token_id=[2],
    disable_compile=True,
)
L = max(len(p) for p in prompt_ids)
out = open(f"/tmp/lvt-footing/hf-{mode}.jsonl", "a")
torch.manual_seed(int(sys.argv[3]) if len(sys.argv) > 3 else 0)
batches = [list(range(8))] if mode.endswith("mixed") else [[ti] for ti in range(8)]
for tis in batches:
    t0 = time.time()
    index = [ti for ti in tis for _ in range(samples)]
    ids = torch.tensor([[2] * (L - len(prompt_ids[ti])) + list(prompt_ids[ti]) for ti in index])
    mask = torch.tensor([[0] * (L - len(prompt_ids[ti])) + [1] * len(prompt_ids[ti]) for ti in index])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode.startswith("bf16")):
        seqs = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
    comps = []
    for row in seqs[:, L:].tolist():
        n = row.index(2) + 1 if 2 in row else len(row)
        comps.append(row[:n])
    texts = tok.batch_decode(comps, skip_special_tokens=True)
    rewards = asyncio.run(score(texts, index))
    for c, t, r, ti in zip(comps, texts, rewards, index):
        out.write(json.dumps({"task_index": ti, "reward": r, "text": t, "n_tokens": len(c), "eos": c[-1] == 2}) + "\n")
    out.flush()
    print(f"tasks {tis}: {sum(rewards) / len(rewards):.3f} ({time.time() - t0:.0f} s)", flush=True)
