"""Soak: does anything grow with the iteration count? A long ``pettingflow train`` run, sampled once per iteration.

    .venv/bin/python -m bench.soak --out /data/soak --iterations 300 --scripted       # tiny model, scripted LLM
    .venv/bin/python -m bench.soak --out /data/soak --iterations 300 [overrides...]   # the config's own servers
    .venv/bin/python -m bench.soak --out /data/soak --report                          # slopes of what was recorded

The run is ``pettingflow train`` in a subprocess (so its process tree is measured from outside, and a kill of it is
a kill of a real run). Each time an iteration's report commits, one sample goes to ``<out>/samples.jsonl``: the
run's process tree (resident memory, open files, threads, processes), the run folder's bytes, the state folder's
(logs, Prefect's database when local) and the time since the previous report. At the end, and with ``--report``,
each metric's least-squares slope per 100 iterations is printed beside its first and last value: a flat run has
slopes near 0 except for the run folder (trajectories and reports grow by design; checkpoints must not: the
``disk`` settings, docs/flows.md).

Resumable: ``<out>/soak.json`` keeps the run id and the arguments; running the same command again resumes the run
(``--run-id``) and appends samples of the iterations not yet recorded. ``--scripted`` serves canned answers
(``bench/scripted_server.py``) to a tiny random model, so an iteration costs seconds and the bench measures the
orchestration, storage and learner rather than generation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench import common

METRICS = ("rss_mb", "open_files", "threads", "processes", "run_mb", "state_mb", "iteration_s")


def tree_usage(pid: int) -> dict[str, float]:
    """Resident memory (MB), open files, threads and processes of ``pid`` and everything below it."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    rss = files = threads = 0
    alive = 0
    for proc in procs:
        try:
            with proc.oneshot():
                rss += proc.memory_info().rss
                files += proc.num_fds()
                threads += proc.num_threads()
                alive += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return {"rss_mb": rss / 2**20, "open_files": files, "threads": threads, "processes": alive}


def folder_mb(path: Path) -> float:
    if not path.exists():
        return 0.0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) / 2**20


def slope_per_100(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (iterations), per 100 iterations; 0 with fewer than 2 points."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else 100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


def read_samples(out: Path) -> list[dict[str, Any]]:
    path = out / "samples.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def report(out: Path) -> None:
    samples = read_samples(out)
    if not samples:
        print(f"no samples in {out}/samples.jsonl")
        return
    xs = [float(s["iteration"]) for s in samples]
    rows = []
    for metric in METRICS:
        pairs = [(x, float(s[metric])) for x, s in zip(xs, samples, strict=True) if s.get(metric) is not None]
        if pairs:
            px, py = zip(*pairs, strict=True)
            rows.append([metric, py[0], py[-1], slope_per_100(list(px), list(py))])
    common.print_table(
        ["metric", "first", "last", "slope / 100 iterations"], rows, title=f"soak: {len(samples)} iterations sampled"
    )


def scripted_setup(stack: ExitStack, out: Path, meta: dict[str, Any]) -> list[str]:
    """The scripted LLM server and a tiny random model (the tokenizer of the default model): their overrides. The
    server's port is recorded in ``meta`` (soak.json) the first time."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from bench.scripted_server import ScriptedServer
    from pettingflow.envs import load_humaneval
    from pettingflow.envs.basic_python import load_basic_python

    tok = AutoTokenizer.from_pretrained(common.model_dir(), local_files_only=True)
    model = out / "tiny-model"
    if not (model / "config.json").exists():
        shape = {"vocab": len(tok), "hidden": 32, "intermediate": 64, "layers": 2, "heads": 4, "kv_heads": 2}
        cfg = common.random_llama_config(shape)
        cfg.bos_token_id, cfg.eos_token_id = tok.bos_token_id, tok.eos_token_id
        import torch

        torch.manual_seed(0)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model)
        tok.save_pretrained(model)
    tasks = [*load_humaneval(), *load_basic_python()]
    solutions = {t["entry_point"]: t["prompt"] + t["canonical_solution"] for t in tasks}
    # the run's config names the server's URL: a resumed soak serves on the port the run started with
    server = stack.enter_context(ScriptedServer(tok, solutions, port=meta.get("scripted_port", 0)))
    meta["scripted_port"] = int(server.url.rsplit(":", 1)[1])
    return [
        f"policies.0.model={model}",
        f"inference.url={server.url}",
        "rollout.use_ray=false",
        "env.tasks_per_iteration=2",
        "env.group_size=2",
        "env.max_turns=2",
        "algorithm.filter_method=none",
        "validation.frequency=0",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="where the run, soak.json and samples.jsonl live")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--config", default="code-env")
    parser.add_argument("--scripted", action="store_true", help="tiny random model + scripted LLM server")
    parser.add_argument("--poll-s", type=float, default=2.0)
    parser.add_argument("--report", action="store_true", help="only print the slopes of what was recorded")
    parser.add_argument("overrides", nargs="*", help="config overrides (kept in soak.json for a resume)")
    args = common.parse_args(parser, argv, wait=False)
    out: Path = args.out.resolve()
    if args.report:
        report(out)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "soak.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
    if meta is None:
        meta = {
            "run_id": f"soak-{time.strftime('%Y%m%d-%H%M%S')}",
            "config": args.config,
            "iterations": args.iterations,
            "scripted": args.scripted,
            "overrides": list(args.overrides),
        }
        meta_path.write_text(json.dumps(meta, indent=2))
    os.environ.setdefault("PETTINGFLOW_STATE", str(out / "state"))
    os.environ.setdefault("PREFECT_HOME", str(out / "prefect"))
    from pettingflow.storage import RunLayout
    from pettingflow.storage.layout import StepName

    root = out / "outputs"
    layout = RunLayout(str(root), meta["run_id"])
    seen = {s["iteration"] for s in read_samples(out)}
    with ExitStack() as stack:
        extra = scripted_setup(stack, out, meta) if meta["scripted"] else []
        meta_path.write_text(json.dumps(meta, indent=2))
        overrides = [f"run.storage_root={root}", f"run.iterations={meta['iterations']}", *extra, *meta["overrides"]]
        # a fixed run id: the first command starts the run, the same command again resumes it
        command = [str(Path(sys.executable).parent / "pettingflow"), "train", meta["config"], *overrides]
        command += ["--run-id", meta["run_id"]]
        log = stack.enter_context(open(out / "train.log", "a"))
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        previous = None
        while True:
            done = proc.poll() is not None
            for k in range(meta["iterations"]):
                step = layout.step(k, StepName.REPORT)
                if not step.is_committed():
                    break
                at = step.manifest().committed_at
                if k not in seen:
                    sample = {"iteration": k, "at": at, **tree_usage(proc.pid)}
                    sample["run_mb"] = folder_mb(Path(layout.run_path))
                    sample["state_mb"] = folder_mb(out / "state") + folder_mb(out / "prefect")
                    sample["iteration_s"] = at - previous if previous is not None else None
                    with open(out / "samples.jsonl", "a") as f:
                        f.write(json.dumps(sample) + "\n")
                    seen.add(k)
                    print(f"iteration {k}: {json.dumps({m: sample.get(m) for m in METRICS})}", flush=True)
                previous = at
            if done:
                break
            time.sleep(args.poll_s)
    print(f"pettingflow train exited with {proc.returncode} (log: {out / 'train.log'})")
    report(out)
    return proc.returncode or 0


if __name__ == "__main__":
    raise SystemExit(main())
