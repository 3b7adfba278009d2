"""The Prefect side of a long run without the training: how the server's database and the UI's queries grow with the
number of iterations (docs/flows.md, "A long run's Prefect database").

    .venv/bin/python -m bench.soak_prefect --out /work/soak/prefect-scale --iterations 500 --every 50

A flow shaped like ``train`` runs against a Prefect server of its own (SQLite under ``--out``, a free loopback
port; ``bench/soak_stack.py``): one ``iteration`` subflow per iteration with the rows a real iteration leaves in
Prefect's database, as counted on a soak's run (``bench/soak.py``, ``db_rows/*``): 8 task runs (the steps and the
retention task), about 12 log lines, 4 artifacts with the iteration's key and a new version of the run's curve.
The tasks do nothing else, so hundreds of iterations take minutes, not days. Every ``--every`` iterations it times
the queries the UI's runs and dashboard pages make (``soak_stack.api_timings``) and records the database's size and
rows; the table is printed at the end and written to ``<out>/prefect_scale.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from bench import common
from bench.soak_stack import SoakStack, api_timings, db_rows, fresh_port
from pettingflow.storage.layout import StepName

# the stand-in iteration's task names: the pipeline's steps in order (no baseline or validation: the soak runs
# without them), then the tasks that follow the report
STEPS = (
    *(s.value for s in StepName if s not in (StepName.BASELINE, StepName.VALIDATION)),
    "retention",
    "snapshot",
)


def resident_mb(pid: int) -> float | None:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None


def measure(stack: SoakStack, k: int, started: float) -> dict[str, Any]:
    row: dict[str, Any] = {"iterations": k, "elapsed_s": round(time.time() - started, 1), "load1": os.getloadavg()[0]}
    # the flow runs in this process: its memory is the train flow's and its subflows' bookkeeping, no training
    row["rss_mb/flow"] = resident_mb(os.getpid())
    row["rss_mb/prefect_server"] = resident_mb(stack.pids.get("prefect_server", 0))
    row["db_mb"] = sum(p.stat().st_size for p in stack.db.parent.glob(stack.db.name + "*")) / 2**20
    row.update(db_rows(stack.db))
    row.update(api_timings(stack.api))
    return row


def run(stack: SoakStack, iterations: int, every: int, out: Path) -> list[dict[str, Any]]:
    """The flows, in this process, reporting to ``stack``'s server (PREFECT_API_URL is set before Prefect loads)."""
    os.environ.update({k: v for k, v in stack.env.items() if k.startswith("PREFECT_")})
    from prefect import flow, get_run_logger, task
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    @task
    def step(name: str, k: int) -> int:
        get_run_logger().info("%s of iteration %d: committed", name, k)
        return k

    @flow(name="iteration")
    def iteration(k: int) -> None:
        logger = get_run_logger()
        for name in STEPS:
            step.with_options(name=name)(name, k)
        for line in range(4):
            logger.info("iteration %d: summary line %d", k, line)
        create_table_artifact(key=f"soak-iter-{k}-metrics", table=[{"metric": "reward", "value": 0.5}])
        create_markdown_artifact(key=f"soak-iter-{k}-samples", markdown=f"iteration {k}: samples")
        create_markdown_artifact(key=f"soak-iter-{k}-links", markdown=f"iteration {k}: links")
        create_markdown_artifact(key="soak-curve", markdown=f"curve after iteration {k}")

    rows: list[dict[str, Any]] = []

    @flow(name="train")
    def train() -> None:
        started = time.time()
        for k in range(iterations + 1):
            if k % every == 0:
                rows.append(measure(stack, k, started))
                with open(out / "prefect_scale.jsonl", "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
                keys = ("api_ms/", "db_mb", "rss_mb/")
                shown = {m: round(v) for m, v in rows[-1].items() if m.startswith(keys) and v is not None}
                print(f"{k} iterations: {shown}", flush=True)
            if k < iterations:
                iteration(k)

    train()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak_prefect", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--keep", action="store_true", help="leave the server running afterwards")
    args = common.parse_args(parser, argv, wait=False)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    stack = SoakStack(out, fresh_port())
    # a kill (SIGTERM) or a server that never answers still stops the server and its log pipe (they outlived the
    # bench before: ensure_server raised outside the try, and SIGTERM skipped the finally)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        stack.ensure_server()
        rows = run(stack, args.iterations, args.every, out)
        time.sleep(5)  # the flow's last log lines reach the server
    finally:
        if not args.keep:
            stack.stop()
    metrics = [m for m in rows[-1] if m.startswith("api_ms/")]
    common.print_table(
        [
            "iterations",
            "db MB",
            "flow runs",
            "task runs",
            "logs",
            "events",
            "flow MB",
            "server MB",
            *[m.removeprefix("api_ms/") for m in metrics],
        ],
        [
            [
                r["iterations"],
                r["db_mb"],
                r.get("db_rows/flow_run"),
                r.get("db_rows/task_run"),
                r.get("db_rows/log"),
                r.get("db_rows/events"),
                r.get("rss_mb/flow"),
                r.get("rss_mb/prefect_server"),
                *[r.get(m) for m in metrics],
            ]
            for r in rows
        ],
        title="the Prefect database and the UI's queries (ms) by iterations",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
