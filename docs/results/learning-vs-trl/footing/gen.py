# ruff: noqa  (a scratch script of the footing check, kept as run: raw evidence, not project code)
"""Scratch: does HF generate() (TRL's path: left-padded batch, accelerate-style bf16 autocast) sample from the
same distribution as a full forward on the same sequence? Teacher-force the generated tokens alone (fp32, no
padding) and compare per-token log-probs with the ones generate() computed step by step."""

import json
import sys

import numpy as np
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

torch.set_num_threads(2)
torch.manual_seed(0)
MODEL = "/root/.cache/pettingflow/models/smollm2-135m-instruct"
rows = pq.read_table("/tmp/lvt-pilot/runs/runs/lvt-pf-seed0/iter-0/rollouts/part-00000.parquet").to_pylist()
prompts = [list(r["prompt_ids"]) for r in rows[::4]]
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
autocast = sys.argv[1] == "bf16"
new = int(sys.argv[2])
gc = GenerationConfig(
    max_new_tokens=new,
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
L = max(len(p) for p in prompts)
ids = torch.tensor([[2] * (L - len(p)) + p for p in prompts])
mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
    out = model.generate(
        input_ids=ids, attention_mask=mask, generation_config=gc, output_logits=True, return_dict_in_generate=True
    )
comp = out.sequences[:, L:]
step_lp = torch.stack([torch.log_softmax(x.float(), -1) for x in out.logits], 1)  # batch, steps, vocab
res = []
for i, p in enumerate(prompts):
    c = comp[i].tolist()
    n = c.index(2) + 1 if 2 in c else len(c)
    c = c[:n]
    g = step_lp[i, torch.arange(n), torch.tensor(c)].numpy()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([p + c])).logits.float()
    t = torch.log_softmax(logits[0, len(p) - 1 : len(p) - 1 + n], -1).gather(-1, torch.tensor(c)[:, None])[:, 0].numpy()
    d = np.abs(g - t)
    res.append(
        {
            "pad": L - len(p),
            "n": n,
            "mean_abs": float(d.mean()),
            "max_abs": float(d.max()),
            "first_big": int(np.argmax(d > 0.5)) if (d > 0.5).any() else None,
            "gen_logp": float(g.sum()),
            "tf_logp": float(t.sum()),
        }
    )
    print(res[-1], flush=True)
json.dump(res, open(f"/tmp/lvt-footing/gen-{sys.argv[1]}.json", "w"), indent=1)
