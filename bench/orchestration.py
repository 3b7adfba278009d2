"""Orchestration cost: Prefect + flow glue as a share of one iteration, storage I/O share, and rerun vs update.

    .venv/bin/python -m bench.orchestration                  # 1 iteration per run, 2 runs, 2 tasks
    .venv/bin/python -m bench.orchestration --rounds 3 --tasks 8

Each round runs the real ``train`` flow (one iteration) under Prefect's temporary server
(``prefect_test_harness``; its start is not counted), with the default model trained by the real
DeepSpeed worker, the code env with its bubblewrap sandbox, and real Parquet storage. The LLM is the scripted
OpenAI-compatible server the flow tests use too (``bench/scripted_server.py``: canned answers with real token ids,
no-op weight reload), because the model's speed is not what this bench measures; a real vLLM server would
only make the iteration longer and the orchestration share smaller.

The library function of every step (``collect_step``, ``filter_step``, ``advantage_step``, ``update_step``,
``sync_step``, ``validation_step``, ``write_report``, ``log_metrics``) is wrapped with a timer:

- library time = the sum of those wrapped calls;
- orchestration = flow wall time (around ``train(...)``) - library time: Prefect's flow/subflow/task runs,
  state and artifact API calls, config loading, run-info/resume checks and attaching the runtime;
- storage = time in the storage layer in this process (every ``Step`` read/write/commit/manifest call,
  ``write_trajectories``, ``read_step_trajectories``) plus the update worker's checkpoint save
  (``timings.save_s``). Most of it is inside library time; calls made by Prefect tasks outside the step
  functions (commit-marker checks) are inside the orchestration figure too, so the two can overlap a little.

Then ``rerun(run_id, iteration=0, from_step="filtered")`` re-runs filter, advantages, update and report from
the stored trajectories; its wall time is compared with the original iteration's update step alone.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

from bench import common

STATE = common.temp_prefect_state("orch")  # Prefect's database and our state: temp only

LIBRARY = {  # module -> step functions the Prefect tasks call
    "pettingflow.steps.rollouts": ["collect_step", "validation_step"],
    "pettingflow.steps.batches": ["filter_step", "advantage_step"],
    "pettingflow.steps.updates": ["update_step", "sync_step"],
    "pettingflow.steps.report": ["write_report", "log_metrics"],
}
STORAGE = {  # module -> storage functions imported into it
    "pettingflow.steps.rollouts": ["write_trajectories"],
    "pettingflow.steps.batches": ["read_step_trajectories", "write_trajectories"],
    "pettingflow.steps.updates": ["read_step_trajectories"],
}
STEP_METHODS = [  # pettingflow.storage.commits.Step: every read, write and commit of step folders
    "begin",
    "write_bytes",
    "write_file",
    "add_tree",
    "write_json",
    "write_table",
    "commit",
    "read_bytes",
    "read_json",
    "read_table",
    "manifest",
    "is_committed",
]


class Clock:
    def __init__(self) -> None:
        self.library: dict[str, float] = {}
        self.storage = 0.0
        self.depth = 0  # storage calls inside storage calls are counted once

    def reset(self) -> None:
        self.library = {}
        self.storage = 0.0

    def wrap_library(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = common.Timer().__enter__()
            try:
                return fn(*args, **kwargs)
            finally:
                t.__exit__()
                self.library[name] = self.library.get(name, 0.0) + t.s

        return timed

    def wrap_storage(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.depth += 1
            t = common.Timer().__enter__()
            try:
                return fn(*args, **kwargs)
            finally:
                t.__exit__()
                self.depth -= 1
                if self.depth == 0:
                    self.storage += t.s

        return timed


def install(clock: Clock) -> None:
    import importlib

    for mod_name, names in LIBRARY.items():
        mod = importlib.import_module(mod_name)
        for n in names:
            setattr(mod, n, clock.wrap_library(n, getattr(mod, n)))
    for mod_name, names in STORAGE.items():
        mod = importlib.import_module(mod_name)
        for n in names:
            if hasattr(mod, n):
                setattr(mod, n, clock.wrap_storage(getattr(mod, n)))
    from pettingflow.storage.commits import Step

    for n in STEP_METHODS:
        if hasattr(Step, n):
            setattr(Step, n, clock.wrap_storage(getattr(Step, n)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.orchestration", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="train-flow runs (one iteration each), then reruns")
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--model", default=common.DEFAULT_MODEL, help="model name or HF folder to train")
    parser.add_argument("overrides", nargs="*", help="extra config overrides")
    args = common.parse_args(parser, argv)

    from prefect.testing.utilities import prefect_test_harness
    from transformers import AutoTokenizer

    from bench.scripted_server import ScriptedServer
    from pettingflow.envs import load_humaneval
    from pettingflow.flows.rerun import rerun
    from pettingflow.flows.train import train
    from pettingflow.steps.report import read_metrics
    from pettingflow.storage import RunLayout, StepName

    model = common.model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    solutions = {t["entry_point"]: t["prompt"] + t["canonical_solution"] for t in load_humaneval()}
    clock = Clock()
    install(clock)
    rows = []
    with common.temp_dir("orchestration") as root, ScriptedServer(tok, solutions) as scripted:
        harness_t = common.Timer().__enter__()
        with prefect_test_harness(server_startup_timeout=180):
            harness_t.__exit__()
            print(f"Prefect test server up after {harness_t.s:.0f} s (not counted)", flush=True)
            for r in range(args.rounds):
                overrides = [
                    f"run.storage_root={root}",
                    "run.iterations=1",
                    f"policies.0.model={model}",
                    f"inference.url={scripted.url}",
                    "rollout.use_ray=false",
                    f"env.tasks_per_iteration={args.tasks}",
                    f"env.group_size={args.group_size}",
                    "validation.num_tasks=2",
                    "training.zero_stage=0",
                    *args.overrides,
                ]
                clock.reset()
                with common.Timer() as flow_t:
                    state = train("code-env", overrides, return_state=True)
                assert state.is_completed(), state
                run_id = state.result()["run_id"]
                lib = dict(clock.library)
                layout = RunLayout(str(root), run_id)
                metrics = read_metrics(layout.step(0, StepName.REPORT))
                save_s = float(metrics.get("update/shared/timings/save_s", 0.0))
                storage = clock.storage + save_s
                # rerun from the stored trajectories
                clock.reset()
                with common.Timer() as rerun_t:
                    rerun(run_id=run_id, iteration=0, from_step=StepName.FILTERED, root=str(root))
                rerun_lib = sum(clock.library.values())
                rows.append(
                    {
                        "flow": flow_t.s,
                        "library": sum(lib.values()),
                        "steps": lib,
                        "task_durations": {k: v for k, v in metrics.items() if k.startswith("duration/")},
                        "storage": storage,
                        "update": lib.get("update_step", float("nan")),
                        "rerun": rerun_t.s,
                        "rerun_lib": rerun_lib,
                    }
                )
                x = rows[-1]
                print(
                    f"  round {r + 1}: flow {x['flow']:.1f} s, library {x['library']:.1f} s "
                    f"(orchestration {x['flow'] - x['library']:.2f} s), storage {storage:.2f} s, "
                    f"update step {x['update']:.1f} s, rerun {x['rerun']:.1f} s",
                    flush=True,
                )
                print("    library per step (s): " + ", ".join(f"{k} {v:.2f}" for k, v in lib.items()), flush=True)
                print(
                    "    task durations in the report (s): "
                    + ", ".join(f"{k[9:]} {v:.2f}" for k, v in x["task_durations"].items()),
                    flush=True,
                )
    med = common.median
    orch = [(x["flow"] - x["library"]) / x["flow"] for x in rows]
    store = [x["storage"] / x["flow"] for x in rows]
    rerun_ratio = [x["rerun"] / x["update"] for x in rows]
    common.print_table(
        ["what", "seconds", "share of flow"],
        [
            ("train flow, one iteration (wall)", med([x["flow"] for x in rows]), 1.0),
            (
                "library time of the steps (sum)",
                med([x["library"] for x in rows]),
                med([x["library"] / x["flow"] for x in rows]),
            ),
            ("orchestration = wall - library", med([x["flow"] - x["library"] for x in rows]), med(orch)),
            ("storage (Parquet I/O + checkpoint save)", med([x["storage"] for x in rows]), med(store)),
            ("update step (library)", med([x["update"] for x in rows]), med([x["update"] / x["flow"] for x in rows])),
            (
                "rerun from 'filtered' (wall)",
                med([x["rerun"] for x in rows]),
                med([x["rerun"] / x["flow"] for x in rows]),
            ),
            (
                "  of which library",
                med([x["rerun_lib"] for x in rows]),
                med([x["rerun_lib"] / x["flow"] for x in rows]),
            ),
        ],
        title=f"medians over {args.rounds} run(s); the LLM is scripted, the update is real",
    )
    print(common.ratio_line("orchestration share of one iteration", orch, 0.03, higher_is_better=False))
    print(
        common.ratio_line(
            "orchestration + storage share", [a + b for a, b in zip(orch, store, strict=True)], 0.03, False
        )
    )
    print(
        f"rerun wall / update step: median {med(rerun_ratio):.3f} "
        f"(rounds: {', '.join(f'{v:.3f}' for v in rerun_ratio)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
