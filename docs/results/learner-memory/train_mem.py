"""Does a bf16 CPU training step's process grow with new sequence lengths? Resident memory after a release, per step.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 OMP_NUM_THREADS=1 \
        .venv/bin/python docs/results/learner-memory/train_mem.py 14 random      # lengths 150..700
    (the same with ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 DNNL_PRIMITIVE_CACHE_CAPACITY=0: oneDNN's cache off)

SmolLM2-135M-Instruct (the prepared folder), 2 rows per step, forward + backward + AdamW step, tcmalloc's free memory
handed back after each step (as a learner rank does after an update). Kept beside its logs (Nov 29); not a bench.
"""

import ctypes
import random
import sys
import time

import torch
from transformers import AutoModelForCausalLM

torch.set_num_threads(1)
steps, fixed = int(sys.argv[1]), sys.argv[2] == "fixed"
model = AutoModelForCausalLM.from_pretrained(
    "/root/.cache/pettingflow/models/smollm2-135m-instruct", torch_dtype=torch.bfloat16
)
opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
lib = ctypes.CDLL(None)
release = getattr(lib, "MallocExtension_ReleaseFreeMemory", None)


def rss_mb() -> float:
    release() if release else lib.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


rng = random.Random(0)
for s in range(steps):
    n = 300 if fixed else rng.randint(150, 700)
    ids = torch.randint(0, 49152, (2, n))
    t = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step {s} len {n}: {rss_mb():.1f} MB {time.perf_counter() - t:.2f} s", flush=True)
