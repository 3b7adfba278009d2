"""Children started through pettingflow.deathsig die when their parent is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil


def test_child_dies_with_killed_parent(tmp_path) -> None:
    marker = tmp_path / "child.pid"
    child_code = f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    script = tmp_path / "parent.py"
    script.write_text(
        "import signal, subprocess, sys, time\n"
        "from pettingflow import deathsig\n"
        f"cmd = deathsig.wrap([sys.executable, '-c', {child_code!r}], signal.SIGKILL)\n"
        "subprocess.Popen(cmd, start_new_session=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
    deadline = time.monotonic() + 30
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline, "child never started"
        time.sleep(0.1)
    child = psutil.Process(int(marker.read_text()))
    assert child.is_running()
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    gone, _ = psutil.wait_procs([child], timeout=10)
    assert gone, "the child outlived its SIGKILLed parent"


def test_wrap_keeps_the_command() -> None:
    from pettingflow import deathsig

    wrapped = deathsig.wrap(["echo", "hi"])
    assert wrapped[-2:] == ["echo", "hi"] and "pettingflow.deathsig" in wrapped
    assert subprocess.run(wrapped, capture_output=True, text=True, check=True).stdout == "hi\n"


def test_parent_gone_before_the_child_started_kills_the_child() -> None:
    """The race: the parent dies while the wrapper's interpreter starts. The wrapper is told the parent's
    pid; finding another parent (the reaper) means the parent is gone, so it must not run the command."""
    not_my_parent = str(os.getpid() + 1_000_000)  # no such process: as if the real parent had died
    cmd = [sys.executable, "-m", "pettingflow.deathsig", "SIGKILL", not_my_parent, "--", "sleep", "60"]
    proc = subprocess.run(cmd, timeout=60)
    assert proc.returncode == -signal.SIGKILL


def test_usage_error_names_the_arguments() -> None:
    proc = subprocess.run([sys.executable, "-m", "pettingflow.deathsig", "SIGTERM", "--", "true"], capture_output=True)
    assert proc.returncode != 0 and b"SIGNAL PARENT_PID -- CMD" in proc.stderr


def test_group_mode_kills_the_whole_group_even_paused_or_ignoring_sigterm(tmp_path) -> None:
    """Group mode (the vLLM server's): after the parent's SIGKILL the command's child, which ignores SIGTERM,
    and the command itself, paused with SIGSTOP as between updates, are all gone after the grace period."""
    marker = tmp_path / "pids"
    server_code = (
        "import os, signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'])\n"
        f"open({str(marker)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(120)\n"
    )
    script = tmp_path / "parent.py"
    script.write_text(
        "import signal, subprocess, sys, time\n"
        "from pettingflow import deathsig\n"
        f"cmd = deathsig.wrap([sys.executable, '-c', {server_code!r}], signal.SIGTERM, group_grace_s=1.0)\n"
        "subprocess.Popen(cmd, start_new_session=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
    deadline = time.monotonic() + 30
    while not marker.exists() or len(marker.read_text().split()) < 2:
        assert time.monotonic() < deadline, "command never started"
        time.sleep(0.1)
    server, child = (psutil.Process(int(pid)) for pid in marker.read_text().split())
    assert server.cmdline()[:2] == [sys.executable, "-c"]  # the wrapper exec'd the command: same pid
    server.suspend()
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    _, alive = psutil.wait_procs([server, child], timeout=15)
    assert not alive, f"outlived the SIGKILLed parent: {alive}"


def test_group_mode_runs_the_command_and_keeps_its_exit_status() -> None:
    from pettingflow import deathsig

    wrapped = deathsig.wrap([sys.executable, "-c", "import sys; print('hi'); sys.exit(3)"], group_grace_s=1.0)
    proc = subprocess.run(wrapped, capture_output=True, text=True, timeout=30, start_new_session=True)
    assert proc.returncode == 3 and proc.stdout == "hi\n"  # the watcher holds no pipe: EOF came at once


def test_kill_with_this_process_kills_registered_pids_once_the_process_is_gone(tmp_path):
    """A process registers a pid it did not start as its child's child; when it exits, the watcher kills it."""
    victim = subprocess.Popen(["sleep", "300"], start_new_session=True)
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        code = f"from pettingflow import deathsig; deathsig.kill_with_this_process([{victim.pid}]); print('ok')"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == "ok", out.stderr
        assert victim.wait(timeout=20) == -signal.SIGKILL
        assert bystander.poll() is None  # only the registered pid
    finally:
        for p in (victim, bystander):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_group_members_are_the_process_group_killpg_reaches_not_the_session() -> None:
    """A process that moved to a group of its own within the session is not a member: a group kill cannot reach
    it, so waiting for it would only stall the kill."""
    from pettingflow.deathsig import _group_members, session_members

    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time\n"
            "a = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "b = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], process_group=0)\n"
            "print(a.pid, b.pid, flush=True); time.sleep(60)",
        ],
        start_new_session=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        same_group, own_group = map(int, leader.stdout.readline().split())
        deadline = time.monotonic() + 10
        while len(_group_members(leader.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(_group_members(leader.pid)) == sorted([leader.pid, same_group])
        assert _group_members(own_group) == [own_group] and os.getsid(own_group) == leader.pid
        assert sorted(session_members(leader.pid)) == sorted([leader.pid, same_group, own_group])
    finally:
        os.killpg(leader.pid, 9)
        os.kill(own_group, 9)
        leader.wait()
