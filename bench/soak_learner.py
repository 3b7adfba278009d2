"""Does a resident learner rank's memory grow with the number of updates, or with the batches it has seen?

    .venv/bin/python -m bench.soak_learner --run /work/soak/main/outputs/runs/<run_id> --batches 25 --cycles 2

Replays a run's stored batches (``iter-<k>/advantages/batch-<policy>.parquet``, as the run's update specs name them)
through one resident learner, the run's own update spec each time (weights chained update to update, an optimizer
snapshot after each as the run's ``training.optimizer_snapshot: background`` writes it), ``--cycles`` times over
the same ``--batches`` batches. A leak grows in every cycle; a high-water mark of the allocator, set by the longest
batches, grows in the first cycle only. Per update it prints the rank's resident memory before and after the
release that follows every update (``UpdateWorker.release_memory``), the peak (``ru_maxrss``) and the update's time.

It found (Nov 28, docs/benchmarks.md "bench/soak.py"): the soak's learner rank rose from 4.0 to 5.2 GB over the first
25 batches in steps at the longest ones and stayed within 5,188..5,205 MB while the same 25 batches were replayed: a
high-water mark, not a leak. With the release after every update (added then), one pass over 14 batches held
2,596 MB after the first update and 3,093..3,105 MB from the 8th on.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from bench import common
from pettingflow.storage.layout import StepName
from pettingflow.training.launch import SPEC_FILE


def specs(run: Path, policy: str, batches: int) -> list[dict[str, Any]]:
    """The run's stored update specs of iterations 0..batches-1 (each names its batch and the run's settings)."""
    out = []
    for k in range(batches):
        path = run / f"iter-{k}" / StepName.UPDATE.folder(policy) / SPEC_FILE
        if not path.exists():
            raise SystemExit(f"{path} is missing: --batches must not exceed the run's committed updates")
        out.append(json.loads(path.read_text()))
    return out


def replay(run: Path, policy: str, batches: int, cycles: int, malloc: str, work: Path) -> list[dict[str, Any]]:
    import psutil
    import ray

    from pettingflow.training.launch import UpdateSpec
    from pettingflow.training.learner import Learner

    stored = specs(run, policy, batches)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    learner = Learner(policy, 1, work / "logs", master_host="127.0.0.1", malloc=malloc).start()
    weights, model_dir, previous = "base", stored[0]["base_model_dir"], None
    rows: list[dict[str, Any]] = []
    try:
        for cycle in range(cycles):
            for i, spec in enumerate(stored):
                k = cycle * batches + i
                out = work / f"u{k}"
                mine = UpdateSpec.model_validate(
                    {
                        **spec,
                        "out_dir": str(out),
                        "out_uri": None,
                        "init_model_dir": model_dir,
                        "resume_dir": None,
                        "start_weights": weights,
                        "weights_uri": f"w{k}",
                        "start_sources": None,
                        "optimizer_age": 0,
                        "save_resume_state": False,
                        "seed": k,
                        "num_threads": 1,
                        "training": {**spec["training"], "malloc": malloc},
                    }
                )
                started = time.perf_counter()
                metrics = learner.update(mine)
                snapshot = learner.save_optimizer(str(out / "snapshot"), f"w{k}")
                if previous is not None:
                    shutil.rmtree(previous, ignore_errors=True)
                weights, model_dir, previous = f"w{k}", metrics["outputs"]["model"], out
                rss = psutil.Process(learner.pids[0]).memory_info().rss / 2**20
                row = {
                    "update": k,
                    "cycle": cycle,
                    "batch": i,
                    "rss_mb_before_release": metrics.get("rss_mb_after_release", 0) + metrics.get("rss_mb_released", 0),
                    "rss_mb_after_release": metrics.get("rss_mb_after_release"),
                    "rss_mb_after_snapshot": round(rss),
                    "snapshot_released_mb": snapshot.get("rss_mb_released"),
                    "peak_mb": metrics.get("max_rss_mb_per_rank"),
                    "update_s": round(time.perf_counter() - started, 1),
                    "release_s": metrics.get("release_memory_s"),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        learner.stop()
        ray.shutdown()
    return rows


def summary(rows: list[dict[str, Any]]) -> list[list[Any]]:
    out = []
    for cycle in sorted({r["cycle"] for r in rows}):
        mine = [r for r in rows if r["cycle"] == cycle]
        for key in ("rss_mb_before_release", "rss_mb_after_snapshot", "peak_mb"):
            values = [r[key] for r in mine if r.get(key) is not None]
            if values:
                out.append([cycle, key, values[0], values[-1], min(values), max(values)])
        out.append([cycle, "update_s (median)", "", "", "", statistics.median(r["update_s"] for r in mine)])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak_learner", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", type=Path, required=True, help="a run folder with committed updates")
    parser.add_argument("--policy", default="shared")
    parser.add_argument("--batches", type=int, default=25)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--malloc", default="auto", choices=("auto", "tcmalloc", "system"))
    parser.add_argument("--out", type=Path, help="also write the rows here (JSON lines)")
    args = common.parse_args(parser, argv, wait=False)
    with common.temp_dir("soak-learner-") as work:
        rows = replay(args.run, args.policy, args.batches, args.cycles, args.malloc, work)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common.print_table(
        ["cycle", "figure", "first", "last", "min", "max"],
        summary(rows),
        title=f"a resident learner replaying {args.batches} batches {args.cycles} times (MB, s)",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
