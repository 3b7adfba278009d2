"""How hard are plan-path boards? Scripted baselines, and the real model on the held-out grids.

    # scripted policies over generated grids (no server, seconds)
    .venv/bin/python scripts/plan_path_difficulty.py baselines rows=8 cols=8 wall_density=0.22 \\
        min_path_len=4 max_path_len=8 max_moves_per_turn=4 --executor-turns 4 --grids 400

    # the config's agents on its held-out grids (validation settings: tasks, samples, temperature), against a
    # running OpenAI-compatible server; prints success and which executor turn reached the goal
    .venv/bin/python scripts/plan_path_difficulty.py model plan-path-learn --url http://127.0.0.1:8011 \\
        --out /tmp/pp-measure env.options.rows=8 validation.samples_per_task=2

Why: docs/plan-path.md sizes the boards so that the untrained SmolLM2-135M team succeeds in 10-30 % of the
held-out episodes and most solved episodes take two executor turns or more (turns matter). The first figure
needs the model; the scripted baselines bracket it cheaply (random moves from below, walking the stated offset
from above) and say how many executor turns a perfect team needs (``ceil(d0 / max_moves_per_turn)``).

``model`` runs the validation step of the rollout pipeline (``steps.rollouts.validation_step``), the held-out
split that ``make learn-plan-path`` scores before and after training, and reads the committed rows back.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from pettingflow.envs.plan_path import MOVES, Grid, PlanPathConfig, generate_grid, walk

Policy = Callable[[Grid, tuple[int, int], int, random.Random], list[str]]


def _random(grid: Grid, here: tuple[int, int], limit: int, rng: random.Random) -> list[str]:
    """1..limit uniformly random moves (a model that writes moves unrelated to the board)."""
    return [rng.choice(sorted(MOVES)) for _ in range(rng.randint(1, limit))]


def _offset(grid: Grid, here: tuple[int, int], limit: int, rng: random.Random) -> list[str]:
    """The stated offset as moves, rows first, ignoring walls: what a reader of "2 rows down and 1 column right"
    writes without looking at the board. Blocked once, it repeats itself and stays blocked."""
    dr, dc = grid.goal[0] - here[0], grid.goal[1] - here[1]
    moves = ["D" if dr > 0 else "U"] * abs(dr) + ["R" if dc > 0 else "L"] * abs(dc)
    return moves[:limit]


def _offset_shuffled(grid: Grid, here: tuple[int, int], limit: int, rng: random.Random) -> list[str]:
    """The stated offset's moves in a random order each turn (a blocked walk may get round the wall next turn)."""
    dr, dc = grid.goal[0] - here[0], grid.goal[1] - here[1]
    moves = ["D" if dr > 0 else "U"] * abs(dr) + ["R" if dc > 0 else "L"] * abs(dc)
    rng.shuffle(moves)
    return moves[:limit]


def _shortest(grid: Grid, here: tuple[int, int], limit: int, rng: random.Random) -> list[str]:
    return (grid.shortest_path(here) or [])[:limit]


POLICIES: dict[str, Policy] = {
    "random": _random,
    "offset": _offset,
    "offset-shuffled": _offset_shuffled,
    "shortest": _shortest,
}


def play(grid: Grid, policy: Policy, limit: int, executor_turns: int, rng: random.Random) -> int | None:
    """The executor turn (1-based) on which ``policy`` reaches the goal, None if it does not within the turns."""
    here = grid.start
    for turn in range(1, executor_turns + 1):
        here = walk(grid, here, policy(grid, here, limit, rng)).end
        if here == grid.goal:
            return turn
    return None


def baselines(knobs: dict[str, Any], grids: int, executor_turns: int, seed: int = 0) -> dict[str, Any]:
    """Success and solving turn of each scripted policy over ``grids`` generated grids (seeds 0..grids-1)."""
    config = PlanPathConfig(**knobs)
    boards = [generate_grid(s, config) for s in range(grids)]
    d0 = Counter(len(b.shortest_path() or []) for b in boards)
    out: dict[str, Any] = {
        "knobs": config.model_dump(include=set(knobs) | {"max_moves_per_turn"}),
        "grids": grids,
        "executor_turns": executor_turns,
        "d0": dict(sorted(d0.items())),
        "needs_2plus_turns": sum(n for d, n in d0.items() if math.ceil(d / config.max_moves_per_turn) >= 2) / grids,
    }
    for name, policy in POLICIES.items():
        rng = random.Random(f"{seed}/{name}")
        turns = [play(b, policy, config.max_moves_per_turn, executor_turns, rng) for b in boards]
        solved = [t for t in turns if t is not None]
        out[name] = {
            "success": len(solved) / grids,
            "solved_on_turn": dict(sorted(Counter(solved).items())),
            "solved_2plus_turns": (sum(t >= 2 for t in solved) / len(solved)) if solved else None,
        }
    return out


def summarize_rows(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per episode (env_idx, rollout_idx): reached the goal, and on which moving turn (the executor's, or the
    solo walker's, whose turns are executor turns too: ``role`` is ``executor`` in both)."""
    episodes: dict[tuple[int, int], dict[str, Any]] = defaultdict(lambda: {"moving_turns": 0, "goal": False})
    replies = invalid = 0
    for row in rows:
        info = json.loads(row["info_json"])
        ep = episodes[(row["env_idx"], row["rollout_idx"])]
        ep["goal"] = bool(info.get("goal_reached"))
        ep["d0"] = info.get("start_distance")
        turn_infos = info.get("turn_infos") or [info.get("turn") or {}]
        for turn in turn_infos:
            replies += 1
            invalid += bool(turn.get("invalid"))
            if turn.get("role") == "executor":
                ep["moving_turns"] += 1
    solved = [ep for ep in episodes.values() if ep["goal"]]
    on_turn = Counter(ep["moving_turns"] for ep in solved)
    return {
        "episodes": len(episodes),
        "solved": len(solved),
        "success": len(solved) / max(len(episodes), 1),
        "solved_on_moving_turn": dict(sorted(on_turn.items())),
        "solved_2plus_turns": (sum(n for t, n in on_turn.items() if t >= 2) / len(solved)) if solved else None,
        "replies": replies,
        "replies_without_moves": invalid,
        "d0": dict(sorted(Counter(ep.get("d0") for ep in episodes.values()).items())),
    }


def model(config_name: str, url: str, out: str, overrides: list[str]) -> dict[str, Any]:
    """The config's validation step (held-out grids) against the server at ``url``; the committed rows summarized."""
    from pettingflow.configs import load_config
    from pettingflow.runs.context import IterationContext
    from pettingflow.runs.run import start_or_resume
    from pettingflow.runs.runtime import Runtime
    from pettingflow.steps.rollouts import validation_step
    from pettingflow.storage import StepName, read_step_trajectories

    all_overrides = [*overrides, f"inference.url={url}", f"run.storage_root={out}"]
    cfg = load_config(config_name, all_overrides)
    ref, _ = start_or_resume(cfg, config_name, all_overrides, None, {"command": "plan_path_difficulty"})
    ctx = IterationContext(ref.layout(), 0)
    with Runtime(cfg, ref.run_id) as runtime:
        outcome = validation_step(ctx, cfg, runtime.endpoints(), env_cache=runtime.env_cache, show_progress=False)
    rows = read_step_trajectories(ctx.step(StepName.VALIDATION)).to_pylist()
    return {
        "config": config_name,
        "overrides": overrides,
        "run_id": ref.run_id,
        "uri": outcome.uri,
        "options": cfg.env.options,
        "max_turns": cfg.env.max_turns,
        **summarize_rows(rows),
    }


def _knob(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    return key, json.loads(value) if value not in ("", "None") else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("baselines", help="scripted policies over generated grids")
    b.add_argument("knobs", nargs="*", help="PlanPathConfig keys as key=value (JSON values)")
    b.add_argument("--grids", type=int, default=400)
    b.add_argument("--executor-turns", type=int, default=3)
    m = sub.add_parser("model", help="the config's agents on its held-out grids, against a running server")
    m.add_argument("config")
    m.add_argument("overrides", nargs="*", help="config overrides as key=value")
    m.add_argument("--url", required=True)
    m.add_argument("--out", default="/tmp/pp-measure")
    args, rest = parser.parse_known_args(argv)
    if args.command == "model":  # overrides after the options land in ``rest``
        if any("=" not in r for r in rest):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides = [*args.overrides, *rest]
    elif rest:
        args.knobs = [*args.knobs, *rest]
    if args.command == "baselines":
        result = baselines(dict(_knob(k) for k in args.knobs), args.grids, args.executor_turns)
    else:
        result = model(args.config, args.url, args.out, args.overrides)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
