"""The bounded log that the Prefect server's output goes through (``pettingflow.logcap``): bounded, newest kept,
counts carried over rotations and restarts, and a Ctrl-C does not cut the logged process's pipe."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from pettingflow.deathsig import session_members
from pettingflow.logcap import HEADER, count_in_log

PATTERN = "database is locked"


def lines(start: int, n: int) -> str:
    return "".join(f"line {i} {PATTERN if i % 3 == 0 else 'ok'} {'x' * 60}\n" for i in range(start, start + n))


def logcap(path: Path, text: str, max_mb: float = 0.05, backups: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pettingflow.logcap", str(path), "--max-mb", str(max_mb)]
    cmd += ["--backups", str(backups), "--count", PATTERN]
    return subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=60)


def test_the_log_stays_bounded_keeps_the_newest_lines_and_counts_every_match(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    n = 5000  # ≈ 420 KB: eight rotations of 50 KB
    done = logcap(log, lines(0, n))
    assert done.returncode == 0, done.stderr
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["server.log", "server.log.1", "server.log.2"]  # backups beyond 2 were dropped
    limit = 0.05 * 2**20 + 200  # one line may cross the limit
    assert all((tmp_path / name).stat().st_size <= limit for name in files)
    live = log.read_text().splitlines()
    assert live[0].startswith(HEADER) and live[-1].startswith(f"line {n - 1} ")
    older = (tmp_path / "server.log.1").read_text().splitlines()
    assert older[-1].startswith(f"line {int(live[1].split()[1]) - 1} ")  # nothing lost between the files
    assert count_in_log(log, PATTERN) == len(range(0, n, 3))  # the dropped files' matches are in the header


def test_a_restart_appends_and_carries_the_counts_on(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    assert logcap(log, lines(0, 3000)).returncode == 0
    assert logcap(log, lines(3000, 100)).returncode == 0
    assert count_in_log(log, PATTERN) == len(range(0, 3100, 3))
    assert log.read_text().splitlines()[-1].startswith("line 3099 ")


def test_a_plain_log_is_just_counted(tmp_path: Path) -> None:
    log = tmp_path / "plain.log"
    log.write_text(lines(0, 10))
    assert count_in_log(log, PATTERN) == 4
    assert count_in_log(tmp_path / "missing.log", PATTERN) == 0


def test_ctrl_c_does_not_cut_the_pipe(tmp_path: Path) -> None:
    """SIGINT reaches the whole foreground group on Ctrl-C; the logged process may still be writing."""
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "pettingflow.logcap", str(log)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    proc.stdin.write("before\n")
    proc.stdin.flush()
    deadline = time.monotonic() + 30
    while "before" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, "logcap wrote nothing in 30 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert proc.poll() is None, "logcap died on SIGINT"
    proc.stdin.write("after\n")
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
    assert log.read_text().splitlines()[1:] == ["before", "after"]


def test_bad_settings_are_refused_with_the_reason(tmp_path: Path) -> None:
    done = logcap(tmp_path / "x.log", "", backups=0)
    assert done.returncode == 2 and "--backups >= 1" in done.stderr


def test_make_runs_server_start_logs_through_logcap_and_make_stop_ends_both(tmp_path: Path) -> None:
    """scripts/prefect_env.sh's start_prefect_server (what `make run` calls), with a stand-in for `prefect`:
    the pid file names the session's leader, the output lands in the capped log, and scripts/stop.sh (`make
    stop`) ends the server, logcap and the leader."""
    import os

    repo = Path(__file__).resolve().parents[1]
    fake = tmp_path / "prefect"
    fake.write_text(f'#!/usr/bin/env bash\necho "started $*"\necho "{PATTERN}"\nexec sleep 300\n')
    fake.chmod(0o755)
    state = tmp_path / "state"
    log, pid_file = state / "logs" / "server.log", state / "pids" / "server.pid"
    script = f'source scripts/prefect_env.sh && PREFECT={fake} && start_prefect_server 4999 "{log}" "{pid_file}"'
    env = {**os.environ, "PETTINGFLOW_STATE": str(state), "PETTINGFLOW_POSTGRES_DIR": str(tmp_path / "pg")}
    subprocess.run(["bash", "-c", script], cwd=repo, env=env, check=True, timeout=30)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while count_in_log(log, PATTERN) < 1:
        assert time.monotonic() < deadline, f"nothing logged in 30 s: {log}"
        time.sleep(0.1)
    assert "started server start --host 127.0.0.1 --port 4999" in log.read_text()
    assert log.read_text().startswith(HEADER) and os.getsid(pid) == pid
    stopped = subprocess.run(["scripts/stop.sh"], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert f"stopping Prefect server (pid {pid})" in stopped.stdout, stopped.stdout + stopped.stderr
    deadline = time.monotonic() + 10  # logcap may finish its last write just after the leader is gone
    while left := session_members(pid):  # setsid made the leader's pid its session's id
        assert time.monotonic() < deadline, f"processes of the server's session outlived make stop: {left}"
        time.sleep(0.1)
    assert not pid_file.exists()
