"""oneDNN's primitive cache in a bf16 CPU training step, arms side by side: memory and time per step.

    .venv/bin/python docs/results/learner-memory/side_by_side.py 12 1024 128 0
    .venv/bin/python docs/results/learner-memory/side_by_side.py 12 1024 1024,LRU_CACHE_CAPACITY=8

One process per capacity (``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` and its old name; ``,NAME=VALUE`` after it adds a
variable to that arm's environment), each running
``train_mem.py``'s step (SmolLM2-135M, bf16, 2 rows of a random length 150..700, AdamW, tcmalloc's free memory
handed back after the step) on the same lengths; the arms take turns, one step at a time, the order rotating, so they
share the machine's load. Prints each arm's growth per step (after 2 warm-up steps) and its median step time, and the
ratio of step times to the first arm's, as a median of per-step ratios. Kept beside its log (Nov 29); not a bench.
"""

import os
import random
import statistics
import subprocess
import sys

WORKER = r"""
import ctypes, sys, time
import torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained("/root/.cache/pettingflow/models/smollm2-135m-instruct",
                                             torch_dtype=torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
lib = ctypes.CDLL(None)
release = getattr(lib, "MallocExtension_ReleaseFreeMemory", None)
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    ids = torch.randint(0, 49152, (2, n))
    t = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    s = time.perf_counter() - t
    release() if release else lib.malloc_trim(0)
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * 4096 / 2**20
    print(f"{rss:.1f} {s:.3f}", flush=True)
"""


def slope(ys: list[float]) -> float:
    xs = range(len(ys))
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    steps, capacities = int(sys.argv[1]), sys.argv[2:]
    tcmalloc = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    procs = {}
    for cap in capacities:
        capacity, *extra = cap.split(",")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LD_PRELOAD": tcmalloc,
               "ONEDNN_PRIMITIVE_CACHE_CAPACITY": capacity, "DNNL_PRIMITIVE_CACHE_CAPACITY": capacity,
               **dict(item.split("=", 1) for item in extra)}  # fmt: skip
        p = subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
        assert p.stdout.readline().strip() == "ready"
        procs[cap] = p
    rng = random.Random(0)
    mb: dict[str, list[float]] = {c: [] for c in capacities}
    secs: dict[str, list[float]] = {c: [] for c in capacities}
    for step in range(steps):
        n = rng.randint(150, 700)
        order = capacities[step % len(capacities) :] + capacities[: step % len(capacities)]
        for cap in order:
            procs[cap].stdin.write(f"{n}\n")
            procs[cap].stdin.flush()
            rss, s = map(float, procs[cap].stdout.readline().split())
            mb[cap].append(rss)
            secs[cap].append(s)
        print(f"step {step} len {n}: " + "; ".join(f"{c}: {mb[c][-1]:.1f} MB {secs[c][-1]:.2f} s" for c in capacities),
              flush=True)  # fmt: skip
    for p in procs.values():
        p.stdin.close()
        p.wait()
    first = capacities[0]
    for cap in capacities:
        ratio = statistics.median(b / a for a, b in zip(secs[first], secs[cap], strict=True))
        print(f"capacity {cap}: {mb[cap][0]:.1f} -> {mb[cap][-1]:.1f} MB, {slope(mb[cap][2:]):+.1f} MB per step after "
              f"2; median step {statistics.median(secs[cap]):.2f} s; time / capacity {first}: {ratio:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
