"""The soak's own Prefect stack, as ``make run`` sets it up: a Prefect server (SQLite under the soak's folder, a
free loopback port, never 4200's), the process work pool with prefect.yaml's deployments, a process worker, and
``prefect deployment run train/<config>`` to start or resume the run (docs/flows.md, "Resume after a crash").

Every process the stack starts carries ``PETTINGFLOW_SOAK=<soak folder>`` in its environment, and so does
everything they start (the flow run's process, its vLLM server, Ray and the learner ranks inherit it). That is how
the bench finds the processes of *its* run among the machine's (other jobs run their own servers and Ray), also after
one was orphaned by a kill, and how the kill mode is sure it signals only its own processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from pettingflow.logcap import count_in_log
from pettingflow.processes import free_port

REPO = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).parent / "prefect")
MARK = "PETTINGFLOW_SOAK"
POOL = "pettingflow"  # prefect.yaml's work pool (in the soak's own database)
#: the roles of a run's processes, in the order tables show them
ROLES = ("prefect_server", "worker", "flow", "vllm", "learner", "ray_workers", "ray_system", "other")
INHERITED = ("prefect_server", "vllm", "learner")
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
LOCK_ERROR = "database is locked"  # the Prefect server's SQLite error (docs/flows.md), counted in its log


def role_of(cmdline: str, name: str) -> str:
    """Which part of the run a process is, from its command line (Ray and vLLM rename their processes). The
    deathsig watchers (``pettingflow.deathsig``, which name the command they watch) are ``other``."""
    if "pettingflow.deathsig" in cmdline:
        return "other"
    if "prefect server start" in cmdline or "prefect.server" in cmdline or "uvicorn" in cmdline:
        return "prefect_server"
    if "prefect worker start" in cmdline:
        return "worker"
    if "ray::LearnerRank" in cmdline or name.startswith("ray::LearnerRank"):
        return "learner"
    if "vllm" in cmdline.lower() or "EngineCore" in name:
        return "vllm"
    if any(a in cmdline or a in name for a in ("ray::DashboardAgent", "ray::RuntimeEnvAgent")):
        return "ray_system"
    if cmdline.startswith("ray::") or name.startswith("ray::"):
        return "ray_workers"
    if any(m in cmdline for m in ("raylet", "gcs_server", "ray/_private", "ray/dashboard", "ray/autoscaler")):
        return "ray_system"
    if "prefect.engine" in cmdline or "prefect/engine" in cmdline or "flow_run" in cmdline:
        return "flow"
    return "other"


@dataclass
class RunProcess:
    pid: int
    ppid: int
    role: str
    cmdline: str
    create_time: float


def run_processes(soak: Path) -> list[RunProcess]:
    """Every live process of this soak's run, with its role: those whose environment carries ``PETTINGFLOW_SOAK``
    (this soak's folder), and everything below them. The descendants count without the mark because a process that
    renames itself (vLLM's ``VLLM::EngineCore``, Ray's ``ray::LearnerRank``: setproctitle) overwrites the memory
    ``/proc/<pid>/environ`` is read from.

    The flow run's process is the worker's child that is no server or Ray process (after a kill of the worker it
    is recognised by its ``prefect.engine`` command line)."""
    mark = str(soak)
    marked: list[psutil.Process] = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            if proc.pid != os.getpid() and proc.environ().get(MARK) == mark:
                marked.append(proc)
    procs: dict[int, psutil.Process] = {p.pid: p for p in marked}
    for proc in marked:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            procs.update({c.pid: c for c in proc.children(recursive=True)})
    found: list[RunProcess] = []
    for proc in procs.values():
        try:
            with proc.oneshot():
                cmd = " ".join(proc.cmdline())
                found.append(RunProcess(proc.pid, proc.ppid(), role_of(cmd, proc.name()), cmd, proc.create_time()))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    workers = {p.pid for p in found if p.role == "worker"}
    for p in found:  # the process worker starts the flow run as its child (`python -m prefect.engine` or alike)
        if p.role == "other" and p.ppid in workers:
            p.role = "flow"
    role = {p.pid: p.role for p in found}
    for p in found:  # helpers of a server or a rank (multiprocessing's resource tracker, ...) count with it
        if p.role == "other" and "pettingflow.deathsig" not in p.cmdline and role.get(p.ppid) in INHERITED:
            p.role = role[p.ppid]
    return sorted(found, key=lambda p: p.pid)


def usage(procs: list[RunProcess]) -> dict[str, float]:
    """Resident memory (MB), open descriptors, threads and processes per role and in total. ``rss_mb`` counts a page
    shared by several processes (torch's libraries, Ray's object store) once per process; ``pss_mb`` divides it
    among them, so its total is what the run takes from the machine."""
    out: dict[str, float] = {}
    for role in (*ROLES, "total"):
        for key in ("rss_mb", "pss_mb", "fds", "threads", "procs"):
            out[f"{key}/{role}"] = 0.0
    for p in procs:
        try:
            proc = psutil.Process(p.pid)
            with proc.oneshot():
                values = {
                    "rss_mb": proc.memory_info().rss / 2**20,
                    "pss_mb": getattr(proc.memory_full_info(), "pss", 0) / 2**20,
                    "fds": float(proc.num_fds()),
                    "threads": float(proc.num_threads()),
                    "procs": 1.0,
                }
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for key, value in values.items():
            out[f"{key}/{p.role}"] += value
            out[f"{key}/total"] += value
        if p.role == "vllm" and (part := vllm_part(p.cmdline, proc)) is not None:
            key = f"rss_mb/vllm/{part}"  # where in vLLM memory grows, if it does
            out[key] = out.get(key, 0.0) + values["rss_mb"]
    return out


def vllm_part(cmdline: str, proc: psutil.Process) -> str | None:
    """Which of vLLM's processes this is: the OpenAI ``api`` server, the ``engine`` core (the scheduler) or a model
    ``worker`` (vLLM renames the last two)."""
    try:
        name = proc.name()
    except psutil.Error:
        return None
    if "EngineCore" in name or "EngineCore" in cmdline:
        return "engine"
    if "Worker" in name or "VLLM::Worker" in cmdline:
        return "worker"
    if "api_server" in cmdline or "vllm serve" in cmdline:
        return "api"
    return None


def kill_pid(target: RunProcess, soak: Path) -> bool:
    """SIGKILL ``target`` only if it is still a process of this soak's run (same pid and start time: a pid reused
    by a stranger's process is never signalled)."""
    for p in run_processes(soak):
        if p.pid == target.pid and p.create_time == target.create_time:
            with contextlib.suppress(psutil.Error):
                psutil.Process(p.pid).send_signal(signal.SIGKILL)
                return True
    return False


class SoakStack:
    """The Prefect server, pool, deployments and worker of one soak, restartable on the same port and database.

    Their pids are kept in ``<out>/stack.json``, so a later part of the soak (another bench process) finds a server
    or worker that is still up and reuses it, and starts whatever is gone."""

    def __init__(self, out: Path, port: int, extra_env: dict[str, str] | None = None):
        self.out, self.port = out, port
        self.state = out / "state"
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.api = f"http://127.0.0.1:{port}/api"
        self.db = out / "prefect" / "prefect.db"
        self.env = {
            **os.environ,
            MARK: str(out),
            "PETTINGFLOW_STATE": str(self.state),
            "PETTINGFLOW_REPO": str(REPO),
            "PREFECT_HOME": str(out / "prefect"),
            "PREFECT_API_URL": self.api,
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{self.db}",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_CLI_PROMPT": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_LOGGING_EXTRA_LOGGERS": "pettingflow",  # as make run: the library's lines in the UI
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
            **(extra_env or {}),
        }
        for name in ("PETTINGFLOW_CRASH_AT", "PETTINGFLOW_HOLD_AT", "PETTINGFLOW_TEST_VLLM_URL"):
            self.env.pop(name, None)
        self.pids: dict[str, int] = {}
        path = out / "stack.json"
        if path.exists():
            self.pids = json.loads(path.read_text()).get("pids", {})

    # -- processes -------------------------------------------------------------------------------------------
    def _save(self) -> None:
        (self.out / "stack.json").write_text(json.dumps({"port": self.port, "pids": self.pids}, indent=2))

    def alive(self, role: str) -> bool:
        pid = self.pids.get(role)
        if not pid:
            return False
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            return proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(MARK) == str(self.out)
        return False

    def _spawn(self, role: str, args: list[str], capped_log: bool = False) -> None:
        """Start one process of the stack in its own session, its output appended to ``logs/<role>.log``; with
        ``capped_log`` through ``pettingflow.logcap`` (20 MB, two backups, the lock errors counted), as ``make run``
        starts the Prefect server. The role's pid is the process's own, never the log's."""
        log = open(self.logs / f"{role}.log", "a")  # noqa: SIM115 - the child writes to it for its life
        log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(args)}\n")
        log.flush()
        proc = subprocess.Popen(
            args, env=self.env, cwd=REPO, stdout=subprocess.PIPE if capped_log else log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own group: the soak's Ctrl-C does not reach it, and it outlives the bench
        )  # fmt: skip
        if capped_log:
            log.close()
            subprocess.Popen(
                [sys.executable, "-m", "pettingflow.logcap", str(self.logs / f"{role}.log"), "--count", LOCK_ERROR],
                env=self.env, cwd=REPO, stdin=proc.stdout, stdout=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
            assert proc.stdout is not None
            proc.stdout.close()  # logcap holds the pipe now: it ends after the server's last line
        self.pids[role] = proc.pid
        self._save()

    def healthy(self) -> bool:
        import httpx

        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.api}/health", timeout=5).status_code == 200
        return False

    def ensure_server(self, timeout_s: float = 180) -> bool:
        """Start the server unless it is up; True when it was (re)started."""
        if self.alive("prefect_server") and self.healthy():
            return False
        if self.alive("prefect_server"):  # up but not answering yet (or wedged): give it a moment
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if self.healthy():
                    return False
                time.sleep(2)
        self.db.parent.mkdir(parents=True, exist_ok=True)
        server = [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)]
        self._spawn("prefect_server", server, capped_log=True)
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if time.monotonic() > deadline or not self.alive("prefect_server"):
                raise RuntimeError(
                    f"the soak's Prefect server did not answer on {self.api}: {self.logs}/prefect_server.log"
                )
            time.sleep(1)
        return True

    def ensure_deployments(self) -> None:
        """The process work pool and prefect.yaml's deployments, as ``make run`` creates them (idempotent)."""
        for args in (["work-pool", "inspect", POOL], ["--no-prompt", "deploy", "--all"]):
            done = subprocess.run([PREFECT, *args], env=self.env, cwd=REPO, capture_output=True, text=True, timeout=600)
            if args[0] == "work-pool" and done.returncode != 0:
                subprocess.run(
                    [PREFECT, "work-pool", "create", POOL, "--type", "process"],
                    env=self.env, cwd=REPO, capture_output=True, text=True, timeout=300, check=True,
                )  # fmt: skip
            elif args[0] != "work-pool" and done.returncode != 0:
                raise RuntimeError(f"prefect deploy failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")

    def ensure_worker(self) -> bool:
        if self.alive("worker"):
            return False
        self._spawn("worker", [PREFECT, "worker", "start", "--pool", POOL])
        return True

    # -- the run ---------------------------------------------------------------------------------------------
    def deployment_run(self, config: str, params: dict[str, Any]) -> str:
        """``prefect deployment run train/<config> --params ...``: the documented start and resume; the flow run id."""
        cmd = [PREFECT, "deployment", "run", f"train/{config}", "--params", json.dumps(params)]
        done = subprocess.run(cmd, env=self.env, cwd=REPO, capture_output=True, text=True, timeout=300)
        found = re.search(r"UUID: ([0-9a-f-]{36})", done.stdout)
        if done.returncode != 0 or not found:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        return found.group(1)

    def flow_run_state(self, flow_run_id: str) -> str | None:
        """The flow run's state type (RUNNING, COMPLETED, CRASHED, ...); None when the server does not answer."""
        import httpx

        with contextlib.suppress(httpx.HTTPError, KeyError, TypeError, ValueError):
            got = httpx.get(f"{self.api}/flow_runs/{flow_run_id}", timeout=10)
            got.raise_for_status()
            return got.json()["state"]["type"]
        return None

    def mark_crashed(self, flow_run_id: str, why: str) -> None:
        """A flow run whose process is gone but whose state the server never heard end (its worker was killed too, or
        the server was down): CRASHED, so the UI does not show a run that runs forever."""
        import httpx

        with contextlib.suppress(httpx.HTTPError):
            httpx.post(
                f"{self.api}/flow_runs/{flow_run_id}/set_state",
                json={"state": {"type": "CRASHED", "message": why}, "force": True},
                timeout=10,
            )

    def stop(self) -> None:
        """SIGINT then SIGKILL the worker's and the server's process groups (this soak's only)."""
        for role in ("worker", "prefect_server"):
            if self.alive(role):
                pid = self.pids[role]
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGINT)
                with contextlib.suppress(psutil.Error):
                    psutil.Process(pid).wait(timeout=30)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)


def api_timings(api: str) -> dict[str, float]:
    """The time of a few queries the Prefect UI makes on its runs and dashboard pages, and the table sizes they
    scan: flow runs and task runs counted, the newest 50 flow runs and their task runs, the run history."""
    import httpx

    out: dict[str, float] = {}
    queries: dict[str, tuple[str, dict[str, Any]]] = {
        "flow_runs_count": ("/flow_runs/count", {}),
        "task_runs_count": ("/task_runs/count", {}),
        "flow_runs_page": ("/flow_runs/paginate", {"page": 1, "limit": 50, "sort": "START_TIME_DESC"}),
        "task_runs_filter": ("/task_runs/filter", {"limit": 200, "sort": "EXPECTED_START_TIME_DESC"}),
        "flow_runs_history": (
            "/flow_runs/history",
            {
                "history_start": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 7 * 86400)),
                "history_end": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "history_interval_seconds": 3600,
            },
        ),
        "logs_filter": ("/logs/filter", {"limit": 200, "sort": "TIMESTAMP_DESC"}),
    }
    with httpx.Client(base_url=api, timeout=60) as http:
        for name, (path, body) in queries.items():
            started = time.perf_counter()
            try:
                got = http.post(path, json=body)
                got.raise_for_status()
            except httpx.HTTPError:
                continue
            out[f"api_ms/{name}"] = (time.perf_counter() - started) * 1000
            if name.endswith("_count"):
                out[f"prefect/{name.removesuffix('_count')}"] = float(got.json())
    return out


#: the Prefect database's tables that grow with a run (docs.prefect.io "database maintenance": events is often largest)
TABLES = ("flow_run", "task_run", "flow_run_state", "task_run_state", "log", "artifact", "events", "event_resources")


def db_rows(db: Path) -> dict[str, float]:
    """Rows per growing table of the Prefect SQLite database, read through a read-only connection (the server keeps
    writing; WAL mode lets a reader in)."""
    import sqlite3

    out: dict[str, float] = {}
    if not db.exists():
        return out
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as con:
        for table in TABLES:
            with contextlib.suppress(sqlite3.Error):
                out[f"db_rows/{table}"] = float(con.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
    return out


def log_errors(log: Path, pattern: str = LOCK_ERROR) -> float:
    """Lines holding ``pattern`` in a log since it began (the Prefect server's SQLite lock errors), rotations
    included: ``pettingflow.logcap`` keeps the count of the files it dropped in the live file's header."""
    return float(count_in_log(log, pattern))


def fresh_port() -> int:
    return free_port()
