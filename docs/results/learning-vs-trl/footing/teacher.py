# ruff: noqa  (a scratch script of the footing check, kept as run: raw evidence, not project code)
"""Scratch: HF log-probs of PettingFlow's own pilot completions (vLLM samples) under TRL-like conditions, against
the vLLM sampler's log-probs stored with them. Cheap (forward passes only) and deterministic."""

import json
import sys

import numpy as np
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM

torch.set_num_threads(2)
MODEL = "/root/.cache/pettingflow/models/smollm2-135m-instruct"
rows = pq.read_table("/tmp/lvt-pilot/runs/runs/lvt-pf-seed0/iter-0/rollouts/part-00000.parquet").to_pylist()
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
seqs = [(list(r["prompt_ids"]), list(r["response_ids"]), list(r["sampler_logprobs"])) for r in rows]
max_prompt_all = max(len(p) for p, _, _ in seqs)
seqs = seqs[::4]  # one sample per task: 8 sequences
max_len = max(len(p) + len(c) for p, c, _ in seqs)
max_prompt = max_prompt_all


def logps(prompt, comp, pad_to, autocast):
    """Left-pad prompt so every prompt ends at column ``pad_to`` (as in a generate() batch), run one forward."""
    pad = pad_to - len(prompt)
    ids = torch.tensor([[2] * pad + prompt + comp])
    mask = torch.tensor([[0] * pad + [1] * (len(prompt) + len(comp))])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    lp = torch.log_softmax(logits[0, pad_to - 1 : pad_to - 1 + len(comp)], -1)
    return lp.gather(-1, torch.tensor(comp)[:, None])[:, 0].numpy()


out = {}
CONF = {
    "fp32-nopad": (False, False),
    "fp32-leftpad": (True, False),
    "bf16ac-nopad": (False, True),
    "bf16ac-leftpad": (True, True),
}
for name in sys.argv[1:]:
    pad, ac = CONF[name]
    diffs, sums = [], []
    for p, c, v in seqs:
        h = logps(p, c, max_prompt if pad else len(p), ac)
        d = h - np.array(v)
        diffs.append(np.abs(d).mean())
        sums.append(d.sum())
    out[name] = {
        "mean_abs_token_diff": float(np.mean(diffs)),
        "max_seq_mean_abs": float(np.max(diffs)),
        "mean_seq_logp_diff": float(np.mean(sums)),
    }
    print(name, out[name], flush=True)
json.dump(out, open("/tmp/lvt-footing/teacher-" + "-".join(sys.argv[1:]) + ".json", "w"), indent=1)
sys.exit(0)
