# ruff: noqa  (a scratch script of the footing check, kept as run: raw evidence, not project code)
"""Scratch: reward rates per side with 95 % intervals over the 8 tasks (bootstrap), and PF - TRL paired by task."""

import json
from collections import defaultdict

import numpy as np
import pyarrow.parquet as pq


def load_jsonl(p):
    return [json.loads(l) for l in open(p)]


sides = {}
pilot = pq.read_table("/tmp/lvt-pilot/runs/runs/lvt-pf-seed0/iter-0/rollouts/part-00000.parquet").to_pylist()
sides["pf-pilot (vLLM, 4/task)"] = [{"task_index": r["env_idx"], "reward": r["reward"]} for r in pilot]
sides["pf-resample (vLLM, 8/task)"] = json.load(open("/tmp/lvt-footing/vllm.json"))["rows"]
sides["trl-resample (HF generate as in TRL, 4/task)"] = load_jsonl("/tmp/lvt-footing/hf-bf16-mixed.jsonl")


def per_task(rows):
    by = defaultdict(list)
    for r in rows:
        by[r["task_index"]].append(r["reward"])
    return by


def boot(x, seed=0):
    rng = np.random.default_rng(seed)
    b = x[rng.integers(0, len(x), size=(10000, len(x)))].mean(1)
    return [float(v) for v in np.percentile(b, [2.5, 97.5])]


out = {}
for name, rows in sides.items():
    by = per_task(rows)
    m = np.array([np.mean(by[k]) for k in range(8)])
    out[name] = {
        "n": len(rows),
        "reward_mean": float(np.mean([r["reward"] for r in rows])),
        "ci95_tasks": boot(m),
        "solved": float(np.mean([r["reward"] >= 1 for r in rows])),
        "per_task": [round(float(v), 3) for v in m],
    }
pf_all = per_task(sides["pf-pilot (vLLM, 4/task)"] + sides["pf-resample (vLLM, 8/task)"])
trl_all = per_task(sides["trl-resample (HF generate as in TRL, 4/task)"])
pf_m = np.array([np.mean(pf_all[k]) for k in range(8)])
trl_m = np.array([np.mean(trl_all[k]) for k in range(8)])
out["pf all (12/task)"] = {
    "n": sum(len(v) for v in pf_all.values()),
    "reward_mean": float(pf_m.mean()),
    "ci95_tasks": boot(pf_m),
}
d = pf_m - trl_m
out["pf all - trl resample, paired by task"] = {
    "delta": float(d.mean()),
    "ci95_tasks": boot(d),
    "per_task": [round(float(v), 3) for v in d],
}
# the pilot's TRL draw (32 samples, mean 0.0625) against PF's resample: is 0.0625 unusual for PF's own sampler?
rng = np.random.default_rng(0)
pf_rows = per_task(sides["pf-resample (vLLM, 8/task)"])
draws = np.array(
    [np.mean([x for k in range(8) for x in rng.choice(pf_rows[k], 4, replace=False)]) for _ in range(20000)]
)
out["share of PF 4-per-task subsamples (of its 8/task resample) with mean <= 0.0625"] = float((draws <= 0.0625).mean())
print(json.dumps(out, indent=1))
json.dump(out, open("/tmp/lvt-footing/summary.json", "w"), indent=1)
