"""The code sandbox: every isolation property and limit is tested from the inside, with a positive
control where a pass could otherwise be vacuous (e.g. the concurrency test also shows overlap when
two slots are allowed, the fork bomb must actually hit the process limit)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from pettingflow.configs.settings import SandboxSettings
from pettingflow.envs.sandbox import ExecResult, Sandbox, SandboxUnavailableError, make_sandbox
from pettingflow.envs.sandbox.bubblewrap import BubblewrapSandbox
from pettingflow.envs.sandbox.docker_backend import docker_run_argv
from pettingflow.envs.sandbox.tree_limits import DEFAULT_MAX_INODES, find_delegated_cgroup

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap not installed (`make test` installs it)"
)


def _settings(**overrides) -> SandboxSettings:
    base = {"timeout_s": 5.0, "cpu_time_s": 5, "max_concurrency": 2}
    base.update(overrides)
    return SandboxSettings(**base)


@pytest.fixture(scope="module")
def sandbox() -> BubblewrapSandbox:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    sb = make_sandbox(_settings())
    assert isinstance(sb, BubblewrapSandbox)
    return sb


def _run_json(sb: Sandbox, code: str, **kwargs) -> dict:
    """Run a program that prints one JSON object; fail with its stderr if it did not."""
    result = sb.run(textwrap.dedent(code), **kwargs)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def _live_processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and any(marker in a for a in proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


# --------------------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------------------
def test_exec_result_passed_needs_clean_timely_exit():
    ok = ExecResult(0, False, "", "", False, False, 0.1)
    assert ok.passed
    assert not ExecResult(1, False, "", "", False, False, 0.1).passed
    assert not ExecResult(None, True, "", "", False, False, 0.1, "timeout").passed
    assert not ExecResult(0, True, "", "", False, False, 0.1).passed


def test_exec_result_status_names_the_outcome():
    def result(exit_code, killed_reason=None, timed_out=False, **kw):
        return ExecResult(exit_code, timed_out, "", "", False, False, 0.1, killed_reason, **kw)

    assert result(0).status == "ok"
    assert result(3).status == "failed"
    assert result(None, "timeout", timed_out=True).status == "timeout"
    assert result(None, "signal:SIGSEGV", signal="SIGSEGV").status == "signal"
    for reason in ("output", "memory", "files", "cpu"):
        assert result(None, reason).status == reason
    assert result(1, "memory").status == "memory"  # MemoryError under RLIMIT_AS
    assert not result(0).truncated
    assert ExecResult(0, False, "", "", False, True, 0.1).truncated


@pytest.mark.parametrize("chunk", [1, 7, 1000, 10**6])
def test_a_capped_stream_keeps_its_head_and_tail_within_the_cap(chunk):
    """Whatever the chunking: a stream that fits is kept whole; one over the cap keeps its first and last bytes
    around a marked gap that says how much was cut, and never more than the cap."""
    from pettingflow.envs.sandbox.base import _Capture

    def feed(data: bytes) -> _Capture:
        cap = _Capture(1024, 10**9)
        for i in range(0, len(data), chunk):
            cap.add(data[i : i + chunk])
        return cap

    fits = bytes(range(256)) * 4  # exactly the cap
    assert feed(fits).kept() == fits and not feed(fits).overflow
    stream = b"".join(b"%06d\n" % i for i in range(5000)) + b"VERDICT: 3 passed\n"
    cap = feed(stream)
    kept = cap.kept()
    assert cap.overflow and len(kept) <= 1024
    head, gap, tail = re.match(rb"(.*?)(\n\[\.\.\. \d+ bytes cut[^\]]*\]\n)(.*)", kept, re.S).groups()
    assert stream.startswith(head) and stream.endswith(tail) and tail.endswith(b"VERDICT: 3 passed\n")
    assert int(re.search(rb"(\d+) bytes cut", gap).group(1)) == len(stream) - len(head) - len(tail)
    assert len(head) >= 400 and len(tail) >= 400


@needs_bwrap
def test_correct_solution_passes(sandbox):
    assert isinstance(sandbox, Sandbox)
    code = "def add(a, b):\n    return a + b\n\nassert add(2, 3) == 5\nprint('ok')\n"
    result = sandbox.run(code)
    assert result.passed, result.stderr
    assert result.exit_code == 0 and result.stdout == "ok\n" and result.killed_reason is None


@needs_bwrap
def test_wrong_solution_fails_with_assertion_in_stderr(sandbox):
    code = "def add(a, b):\n    return a - b\n\nassert add(2, 3) == 5, 'add(2, 3) is wrong'\n"
    result = sandbox.run(code)
    assert not result.passed
    assert result.exit_code == 1 and not result.timed_out
    assert "AssertionError: add(2, 3) is wrong" in result.stderr


@needs_bwrap
def test_runs_isolated_python_in_fresh_workdir(sandbox):
    info = _run_json(
        sandbox,
        """
        import json, os, sys
        open("left_behind", "w").write("x")
        print(json.dumps({"isolated": sys.flags.isolated, "cwd": os.getcwd(), "exe": sys.executable,
                          "files": sorted(os.listdir("."))}))
        """,
    )
    assert info["isolated"] == 1 and info["exe"].startswith("/usr/")
    assert info["files"] == ["left_behind"]
    again = _run_json(sandbox, "import json, os; print(json.dumps(sorted(os.listdir('.'))))")
    assert again == []  # nothing survives between runs


# --------------------------------------------------------------------------------------------------
# deadline and process tree
# --------------------------------------------------------------------------------------------------
@needs_bwrap
def test_infinite_loop_times_out_and_whole_tree_is_killed(sandbox):
    marker = f"pf-timeout-{uuid.uuid4().hex}"
    code = f"""
import os, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(0.1)", "{marker}"])
if os.fork() == 0:
    os.setsid()  # escapes the process group, not the pid namespace
    os.execv(sys.executable, [sys.executable, "-c", "while True: pass", "{marker}"])
print("children started", flush=True)
while True:
    pass
"""
    seen: dict[int, int] = {}
    done = threading.Event()

    def watch():
        while not done.is_set():
            for p in _live_processes_with(marker):
                with contextlib.suppress(psutil.Error):
                    seen[p.pid] = p.uids().real
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = sandbox.run(code, timeout_s=2)
    finally:
        done.set()
        watcher.join()
    assert result.timed_out and result.killed_reason == "timeout" and result.exit_code is None
    assert not result.passed
    assert result.duration_s < 2 + 60  # a backstop only: the kill's promptness depends on the machine's load
    assert "children started" in result.stdout  # output written before the kill is kept
    assert len(seen) >= 2, "the test did not observe the sandboxed children; it would prove nothing"
    if os.geteuid() == 0:
        assert all(uid != 0 for uid in seen.values()), f"sandboxed processes ran as host root: {seen}"
    assert _live_processes_with(marker) == []


@needs_bwrap
def test_background_children_die_with_the_program(sandbox):
    marker = f"pf-bg-{uuid.uuid4().hex}"
    code = f"""
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "{marker}"], start_new_session=True)
print("spawned")
"""
    result = sandbox.run(code)
    assert result.passed and result.stdout == "spawned\n"
    assert _live_processes_with(marker) == []


@needs_bwrap
def test_cpu_time_limit_kills_a_busy_program():
    """The CPU-time limit, not the wall-clock deadline, ends a busy loop: what killed it and why is the claim.
    The deadline is far away (on a loaded machine 1 s of CPU can take many seconds of wall time)."""
    sb = make_sandbox(_settings(cpu_time_s=1, timeout_s=120))
    result = sb.run("while True:\n    pass\n")
    assert not result.timed_out and result.exit_code is None
    assert result.killed_reason == "cpu"


# --------------------------------------------------------------------------------------------------
# isolation
# --------------------------------------------------------------------------------------------------
@needs_bwrap
def test_network_is_unreachable(sandbox):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # positive control: the host can reach its own listener
        host_ips = sorted(
            a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET
        )
        info = _run_json(
            sandbox,
            f"""
            import json, socket
            out = {{}}
            def attempt(name, fn):
                try:
                    fn()
                    out[name] = "REACHED"
                except OSError as e:
                    out[name] = type(e).__name__
            def tcp(host, port):
                with socket.create_connection((host, port), timeout=2):
                    pass
            attempt("host_loopback", lambda: tcp("127.0.0.1", {port}))
            for ip in {host_ips!r}:
                attempt("host_ip_" + ip, lambda ip=ip: tcp(ip, {port}))
            attempt("public_ip", lambda: tcp("1.1.1.1", 53))
            attempt("dns", lambda: socket.getaddrinfo("pypi.org", 443))
            out["interfaces"] = [n for _, n in socket.if_nameindex()]
            print(json.dumps(out))
            """,
        )
    assert info.pop("interfaces") == ["lo"]
    assert "REACHED" not in info.values(), info
    assert info["dns"] == "gaierror"


@needs_bwrap
def test_writes_outside_workdir_fail_and_host_tmp_is_invisible(sandbox, tmp_path):
    marker = f"pf-write-{uuid.uuid4().hex}"
    host_file = tmp_path / "host-only.txt"
    host_file.write_text("host data")
    info = _run_json(
        sandbox,
        f"""
        import json, os
        out = {{}}
        for path in ["/usr/{marker}", "/{marker}", "/program/main.py", "/dev/{marker}", "/proc/{marker}",
                     "/tmp/{marker}", "/workdir/{marker}", "/dev/shm/{marker}"]:
            try:
                with open(path, "a") as f:
                    f.write("x")
                out[path] = "written"
            except OSError as e:
                out[path] = type(e).__name__
        out["host_file_visible"] = os.path.exists({str(host_file)!r})
        out["tmp_listing"] = sorted(os.listdir("/tmp"))
        print(json.dumps(out))
        """,
    )
    for path in (f"/usr/{marker}", f"/{marker}", "/program/main.py", f"/dev/{marker}", f"/proc/{marker}"):
        assert info[path] != "written", path
    for path in (f"/tmp/{marker}", f"/workdir/{marker}", f"/dev/shm/{marker}"):
        assert info[path] == "written", path  # the sandbox's own scratch space works
    assert info["host_file_visible"] is False
    assert info["tmp_listing"] == [marker]  # a private /tmp, not the host's
    assert not Path(f"/tmp/{marker}").exists() and not Path(f"/dev/shm/{marker}").exists()
    assert not Path(f"/usr/{marker}").exists()


@needs_bwrap
def test_host_secrets_and_environment_are_invisible(sandbox, monkeypatch, tmp_path):
    token = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("SECRET_TOKEN", token)
    secret = tmp_path / "credentials"
    secret.write_text(token)
    with tempfile.NamedTemporaryFile("w", dir=Path.home(), prefix=".pf-secret-", delete=True) as home_secret:
        home_secret.write(token)
        home_secret.flush()
        probes = [str(secret), home_secret.name, str(Path.home()), "/root", "/etc/passwd", "/etc/shadow",
                  str(Path(__file__).resolve()), "/work", "/var", "/run"]  # fmt: skip
        # A fresh sandbox, so that it is built while SECRET_TOKEN is set in our environment.
        info = _run_json(
            make_sandbox(_settings()),
            f"""
            import json, os
            leaked = []
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    try:
                        if {token!r}.encode() in open(f"/proc/{{pid}}/environ", "rb").read():
                            leaked.append(pid)
                    except OSError:
                        pass
            print(json.dumps({{"env": dict(os.environ), "visible": [p for p in {probes!r} if os.path.exists(p)],
                              "environ_leaks": leaked}}))
            """,
        )
    assert "SECRET_TOKEN" not in info["env"] and token not in json.dumps(info["env"])
    assert set(info["env"]) <= {"PATH", "LANG", "HOME", "TMPDIR", "PWD"}, info["env"]
    assert info["visible"] == []
    assert info["environ_leaks"] == []


@needs_bwrap
def test_unprivileged_uid_and_no_capabilities_inside(sandbox):
    info = _run_json(
        sandbox,
        """
        import ctypes, json, os
        status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
        caps = {k: int(status[k].strip(), 16) for k in ("CapEff", "CapPrm", "CapInh", "CapAmb", "CapBnd")}
        try:
            os.setuid(0)
            setuid = "succeeded"
        except OSError:  # EINVAL: uid 0 is not even mapped in the sandbox's user namespace
            setuid = "denied"
        libc = ctypes.CDLL(None, use_errno=True)
        userns = libc.unshare(0x10000000)  # CLONE_NEWUSER; -1 when --disable-userns works
        print(json.dumps({"ids": [os.getuid(), os.geteuid(), os.getgid(), os.getegid()], "groups": os.getgroups(),
                          "caps": caps, "no_new_privs": status["NoNewPrivs"].strip(), "setuid": setuid,
                          "nested_userns_rc": userns, "errno": ctypes.get_errno(), "pid": os.getpid()}))
        """,
    )
    assert info["ids"] == [65534, 65534, 65534, 65534] and 0 not in info["groups"]
    assert info["caps"] == {"CapEff": 0, "CapPrm": 0, "CapInh": 0, "CapAmb": 0, "CapBnd": 0}
    assert info["no_new_privs"] == "1"
    assert info["setuid"] == "denied"
    assert info["nested_userns_rc"] == -1, info  # --disable-userns: no way back to a full capability set
    assert info["pid"] < 10  # own pid namespace: host processes are invisible


# --------------------------------------------------------------------------------------------------
# resource limits
# --------------------------------------------------------------------------------------------------
@needs_bwrap
def test_memory_hog_is_stopped_and_reported(sandbox):
    fits = sandbox.run("b = bytearray(100 * 1024 * 1024)\nprint(len(b))\n")
    assert fits.passed, fits.stderr  # positive control: 100 MiB is allowed under memory_mb=512
    result = sandbox.run("b = bytearray(2 * 1024 ** 3)\nprint('allocated')\n")
    assert not result.passed and result.stdout == ""
    assert result.killed_reason == "memory"
    assert "MemoryError" in result.stderr


@needs_bwrap
def test_fork_bomb_is_contained_and_does_not_starve_a_concurrent_run():
    marker = f"pf-bomb-{uuid.uuid4().hex}"
    sb = make_sandbox(_settings(max_processes=32, timeout_s=10, max_concurrency=2))
    bomb = f"""
import os, sys
said = False
while True:
    try:
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-I", sys.argv[0], "{marker}"])
    except OSError:
        if not said:
            print("EAGAIN", flush=True)
            said = True
"""
    # Runs while the bomb sits at its limit: RLIMIT_NPROC is per user namespace, i.e. per sandbox,
    # although both run as uid 65534 on the host.
    victim = (
        "import os, time\ntime.sleep(0.5)\npids = []\nfor _ in range(20):\n    pid = os.fork()\n"
        "    if pid == 0:\n        time.sleep(0.3)\n        os._exit(0)\n    pids.append(pid)\n"
        "for pid in pids:\n    os.waitpid(pid, 0)\nprint(len(pids))\n"
    )
    results: dict[str, ExecResult] = {}
    bomber = threading.Thread(target=lambda: results.setdefault("bomb", sb.run(bomb)))
    bomber.start()
    # forced, not timed: the victim starts once the host sees the bomb near its limit, and the bomb must still be
    # there when the victim has finished (its deadline, 10 s, is far behind the victim's run)
    deadline = time.monotonic() + 60
    while len(_live_processes_with(marker)) < 24:
        assert time.monotonic() < deadline and bomber.is_alive(), "the bomb never neared its process limit"
        time.sleep(0.05)
    results["victim"] = sb.run(victim, timeout_s=10)
    bomb_still_at_its_limit = len(_live_processes_with(marker)) >= 24
    bomber.join()
    assert bomb_still_at_its_limit, "the victim did not run while the bomb sat at its limit: it would prove nothing"
    result = results["bomb"]
    assert result.timed_out and not result.passed
    assert "EAGAIN" in result.stdout  # the process limit was hit, not just the deadline
    assert results["victim"].passed and results["victim"].stdout == "20\n", results["victim"]
    assert _live_processes_with(marker) == []
    after = sb.run("print('still fine')")
    assert after.passed and after.stdout == "still fine\n"


@needs_bwrap
def test_file_size_and_workdir_caps():
    sb = make_sandbox(_settings(max_file_mb=2))  # RLIMIT_FSIZE 2 MiB; each tmpfs 2 x 2 MiB
    info = _run_json(
        sb,
        """
        import json
        out = {}
        def write(path, mib):
            try:
                with open(path, "wb") as f:
                    for _ in range(mib):
                        f.write(b"x" * 1024 * 1024)
                return "ok"
            except OSError as e:
                return e.strerror
        out["one_mib"] = write("small", 1)
        out["big_file"] = write("big", 3)
        out["many_files"] = [write(f"part{i}", 1) for i in range(5)]
        print(json.dumps(out))
        """,
    )
    assert info["one_mib"] == "ok"
    assert info["big_file"] == "File too large"  # RLIMIT_FSIZE
    assert "No space left on device" in info["many_files"]  # tmpfs --size caps the total


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
@needs_bwrap
def test_output_flood_is_truncated_and_stopped(stream):
    sb = make_sandbox(_settings(max_output_bytes=4096, timeout_s=10))
    result = sb.run(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 1000)\n")
    text = getattr(result, stream)
    assert getattr(result, f"{stream}_truncated") and result.truncated and 4000 < len(text.encode()) <= 4096
    assert text.startswith("xxx") and "bytes cut" in text and text.endswith("xxx")  # head, the marked gap, tail
    assert result.killed_reason == "output" and result.exit_code is None and not result.timed_out
    assert result.status == "output"
    assert result.duration_s < 5


@needs_bwrap
def test_long_output_keeps_its_head_and_tail_and_the_program_runs_on(sandbox):
    """One line over the cap (64 KiB here) is cut, not fatal: the head, the tail (the verdict printed last) and
    stderr are kept, the middle is drained and dropped with a marked gap, and the program finishes with its
    own exit status."""
    cap = sandbox.settings.max_output_bytes
    code = (
        "import sys\nprint('head', flush=True)\nsys.stderr.write('note on stderr\\n')\n"
        f"print('x' * {4 * cap})\nprint('tail')\nsys.exit(3)\n"
    )
    result = sandbox.run(code)
    assert result.exit_code == 3 and result.killed_reason is None and result.status == "failed"
    assert result.stdout_truncated and result.truncated and not result.stderr_truncated
    assert result.stdout.startswith("head\nxxx") and len(result.stdout.encode()) <= cap
    assert result.stdout.endswith("xxx\ntail\n")
    cut = int(re.search(r"\[\.\.\. (\d+) bytes cut", result.stdout).group(1))
    assert cut + len(result.stdout.encode()) - len(re.search(r"\n\[\.\.\..*\.\.\.\]\n", result.stdout).group(0)) == (
        len("head\n") + 4 * cap + 1 + len("tail\n")
    )  # what was cut and what was kept add up to what the program printed
    assert result.stderr == "note on stderr\n"
    ok = sandbox.run(f"print('y' * {2 * cap})")
    assert ok.passed and ok.truncated  # a truncated run is still judged on its exit status


@needs_bwrap
def test_many_files_are_stopped_by_the_inode_cap(sandbox):
    fits = sandbox.run(
        "import os\nfor d in ('.', '/tmp', '/dev/shm'):\n    for i in range(300):\n"
        "        open(os.path.join(d, f'f{i}'), 'w').close()\nprint('ok')\n"
    )
    assert fits.passed and fits.stdout == "ok\n", fits  # positive control: 900 files are fine
    assert sandbox.max_inodes == DEFAULT_MAX_INODES
    result = sandbox.run(
        "import os\nfor i in range(200_000):\n    open(f'f{i}', 'w').close()\n"
        "    if i == 1000:\n        print('created 1000', flush=True)\nprint('all created')\n"
    )
    assert result.killed_reason == "files" and result.status == "files" and result.exit_code is None
    assert "created 1000" in result.stdout and "all created" not in result.stdout
    assert not result.timed_out


# One child at a time allocates and reports, so the output shows how many held their memory at once.
_MEMORY_HOG = """
import os, time
for _ in range(6):
    r, w = os.pipe()
    if os.fork() == 0:
        held = b"x" * (150 << 20)
        os.write(w, b"!")
        time.sleep(30)
        os._exit(0)
    os.read(r, 1)
    print("held", flush=True)
print("all held")
"""


def _check_memory_hog_stopped(sb: BubblewrapSandbox, bound: str) -> None:
    one = sb.run('held = b"x" * (150 << 20)\nprint("one fits")\n')
    assert one.passed, one.stderr  # positive control: one process fits under memory_mb=256
    result = sb.run(_MEMORY_HOG, timeout_s=20)
    assert result.killed_reason == "memory" and result.status == "memory" and result.exit_code is None, result
    assert result.memory_bound == bound and not result.timed_out
    # stopped at the 2nd child (the watchdog may see it one poll late under load)
    assert 1 <= result.stdout.count("held") <= 3 and "all held" not in result.stdout, result.stdout
    assert result.duration_s < 15


@needs_bwrap
def test_multi_process_memory_hog_is_stopped_by_the_whole_run_bound():
    """6 processes x 150 MiB each fit their per-process limit (256 MiB) but not the run's (256 MiB in all)."""
    sb = make_sandbox(_settings(memory_mb=256, max_processes=16, timeout_s=20))
    assert isinstance(sb, BubblewrapSandbox) and sb.memory_bound in ("cgroup", "watchdog")
    _check_memory_hog_stopped(sb, sb.memory_bound)
    if sb.memory_bound == "cgroup":  # also exercise the fallback
        _check_memory_hog_stopped(
            BubblewrapSandbox(_settings(memory_mb=256, max_processes=16), memory_bound="watchdog"), "watchdog"
        )


@needs_bwrap
def test_cgroup_memory_bound_where_delegated():
    if find_delegated_cgroup() is None:
        pytest.skip("no delegated cgroup v2 subtree with the memory controller here (the watchdog is used)")
    sb = BubblewrapSandbox(_settings(memory_mb=256, max_processes=16), memory_bound="cgroup")
    _check_memory_hog_stopped(sb, "cgroup")


def test_cgroup_memory_bound_refused_without_delegation(monkeypatch):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    import pettingflow.envs.sandbox.bubblewrap as bubblewrap

    monkeypatch.setattr(bubblewrap, "find_delegated_cgroup", lambda: None)
    with pytest.raises(SandboxUnavailableError, match="memory_bound='watchdog'"):
        BubblewrapSandbox(_settings(), memory_bound="cgroup", self_check=False)
    assert BubblewrapSandbox(_settings(), self_check=False).memory_bound == "watchdog"


def test_find_delegated_cgroup_takes_a_delegated_parent(tmp_path):
    mountinfo = f"35 25 0:30 / {tmp_path} rw,relatime shared:9 - cgroup2 cgroup2 rw\n"
    leaf = tmp_path / "svc" / "main"
    leaf.mkdir(parents=True)
    (leaf / "cgroup.subtree_control").write_text("\n")
    (leaf.parent / "cgroup.subtree_control").write_text("cpu pids\n")
    assert find_delegated_cgroup(mountinfo, "0::/svc/main\n", probe=False) is None  # no memory controller
    (leaf.parent / "cgroup.subtree_control").write_text("cpu memory pids\n")
    assert find_delegated_cgroup(mountinfo, "0::/svc/main\n") == leaf.parent
    assert find_delegated_cgroup("", "0::/svc/main\n") is None  # no cgroup2 mount (v1 only)
    assert find_delegated_cgroup(mountinfo, "4:memory:/x\n") is None  # not in the unified hierarchy


@needs_bwrap
def test_segfault_is_reported_as_a_signal(sandbox):
    result = sandbox.run("import ctypes\nprint('before', flush=True)\nctypes.string_at(0)\n")
    assert result.signal == "SIGSEGV" and result.status == "signal"
    assert result.exit_code is None and result.killed_reason == "signal:SIGSEGV" and not result.passed
    assert result.stdout == "before\n"
    clean = sandbox.run("print('fine')")
    assert clean.signal is None and clean.status == "ok"


# --------------------------------------------------------------------------------------------------
# I/O and concurrency
# --------------------------------------------------------------------------------------------------
@needs_bwrap
def test_stdin_passes_through(sandbox):
    code = "import sys\ndata = sys.stdin.read()\nprint(len(data.splitlines()), data.upper()[::-1])\n"
    result = sandbox.run(code, stdin="héllo\nwörld")
    assert result.passed and result.stdout == "2 DLRÖW\nOLLÉH\n"
    empty = sandbox.run("try:\n    input()\nexcept EOFError:\n    print('eof')\n")
    assert empty.stdout == "eof\n"
    big = "x" * 300_000  # larger than a pipe buffer: must not deadlock
    assert sandbox.run("import sys\nprint(len(sys.stdin.read()))", stdin=big).stdout == "300000\n"


_SLEEPER = "import time\nstart = time.time()\ntime.sleep(1.5)\nprint(start, time.time())\n"


def _intervals(results: list[ExecResult]) -> list[tuple[float, float]]:
    for r in results:
        assert r.passed, r.stderr
    return sorted(tuple(map(float, r.stdout.split())) for r in results)


@needs_bwrap
def test_concurrency_bound_serializes_runs():
    sb = make_sandbox(_settings(max_concurrency=1))
    results: list[ExecResult] = []
    threads = [threading.Thread(target=lambda: results.append(sb.run(_SLEEPER))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (_, end_first), (start_second, _) = _intervals(results)
    assert start_second >= end_first, "two runs overlapped although max_concurrency=1"


@needs_bwrap
def test_two_slots_overlap_async():
    """Positive control of the bound: with 2 slots two programs run at once. Forced, not left to timing: each
    program waits in a marked child until the test, watching the host's process list, has seen both children
    alive together, and then ends them (the deadline is only a backstop)."""
    sb = make_sandbox(_settings(max_concurrency=2, timeout_s=300, cpu_time_s=60))
    marker = f"pf-overlap-{uuid.uuid4().hex}"
    child = f"[sys.executable, '-c', 'import time; time.sleep(600)', '{marker}']"
    code = f"import subprocess, sys\nsubprocess.run({child})\n"
    both_seen = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            alive = _live_processes_with(marker)
            if len(alive) >= 2:
                both_seen.set()
                for proc in alive:
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()

    async def both():
        return await asyncio.gather(sb.run_async(code), sb.run_async(code))

    try:
        results = asyncio.run(both())
    finally:
        watcher.join()
        sb.close()
    assert both_seen.is_set(), "max_concurrency=2 did not run two programs at once (positive control)"
    assert not any(r.timed_out for r in results)
    assert _live_processes_with(marker) == []


# --------------------------------------------------------------------------------------------------
# availability: never fall back to running unsandboxed
# --------------------------------------------------------------------------------------------------
def test_missing_bwrap_raises_with_install_hint(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    with pytest.raises(SandboxUnavailableError, match=r"apt-get install -y bubblewrap"):
        make_sandbox(SandboxSettings())


@needs_bwrap
@pytest.mark.parametrize(
    ("weakening", "complaint"),
    [(["--share-net"], "network interfaces visible"), (["--ro-bind", "/etc", "/etc"], "/etc is visible")],
)
def test_refuses_a_bwrap_that_does_not_isolate(weakening, complaint):
    """A bwrap wrapper that weakens one flag must make construction fail, not run code less isolated."""
    folder = Path(tempfile.mkdtemp(prefix="pf-fake-bwrap-"))
    try:
        folder.chmod(0o755)  # the sandbox drops to uid 65534 before exec'ing bwrap
        fake = folder / "bwrap"
        fake.write_text(
            "#!/usr/bin/python3\nimport os, sys\nargs = sys.argv[1:]\n"
            f"if '--unshare-all' in args:\n    i = args.index('--unshare-all') + 1\n    args[i:i] = {weakening!r}\n"
            f"os.execv({shutil.which('bwrap')!r}, ['bwrap', *args])\n"
        )
        fake.chmod(fake.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH | stat.S_IROTH)
        with pytest.raises(SandboxUnavailableError, match=complaint):
            BubblewrapSandbox(_settings(), bwrap=str(fake))
    finally:
        shutil.rmtree(folder)


def test_bwrap_without_namespaces_raises_with_sysctl_hint():
    folder = Path(tempfile.mkdtemp(prefix="pf-fake-bwrap-"))
    try:
        folder.chmod(0o755)
        fake = folder / "bwrap"
        fake.write_text(
            "#!/bin/sh\n"
            'if [ "$1" = "--version" ]; then echo "bubblewrap 0.8.0"; exit 0; fi\n'
            'echo "bwrap: No permissions to creating new namespace, likely because the kernel does not allow '
            'non-privileged user namespaces." >&2\nexit 1\n'
        )
        fake.chmod(0o755)
        with pytest.raises(SandboxUnavailableError, match=r"user\.max_user_namespaces"):
            BubblewrapSandbox(_settings(), bwrap=str(fake))
    finally:
        shutil.rmtree(folder)


def test_interpreter_outside_usr_is_refused(tmp_path):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    venv_like = tmp_path / "python3"  # stands for a virtualenv/pyenv interpreter: not visible inside
    venv_like.write_text("#!/bin/sh\n")
    venv_like.chmod(0o755)
    with pytest.raises(SandboxUnavailableError, match="outside /usr"):
        BubblewrapSandbox(_settings(), python=str(venv_like), self_check=False)


def test_docker_backend_without_engine_raises(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", f"unix:///nonexistent/{uuid.uuid4().hex}/docker.sock")
    with pytest.raises(SandboxUnavailableError, match="Docker") as info:
        make_sandbox(SandboxSettings(backend="docker"))
    assert "bubblewrap" in str(info.value)  # says how to get a working sandbox


def test_docker_command_has_every_isolation_flag():
    s = SandboxSettings(backend="docker", memory_mb=256, max_processes=16, max_file_mb=4)
    argv = docker_run_argv(s, docker_cli="docker", name="c1", program_len=10)
    joined = " ".join(argv)
    for flag in ("--network none", "--read-only", "--cap-drop ALL", "--user 65534:65534", "--memory 256m",
                 "--memory-swap 256m", "--pids-limit 16", "--pull never", "--log-driver none",
                 "--security-opt no-new-privileges", "--rm"):  # fmt: skip
        assert flag in joined, flag
    assert f"--tmpfs /workdir:rw,nosuid,nodev,size=4m,nr_inodes={DEFAULT_MAX_INODES},mode=1777" in joined
    assert argv[argv.index(s.docker_image) + 1 : argv.index(s.docker_image) + 3] == ["python3", "-I"]
    assert "--privileged" not in argv and "--network host" not in joined


# --------------------------------------------------------------------------------------------------
# Ray pool
# --------------------------------------------------------------------------------------------------
def test_ray_pool_requires_ray_or_explicit_init():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("Ray already initialised in this process")
    from pettingflow.envs.sandbox import RaySandboxPool

    with pytest.raises(SandboxUnavailableError, match=r"ray\.init"):
        RaySandboxPool(SandboxSettings(), num_workers=1)
    assert not ray.is_initialized()


@pytest.mark.slow
@needs_bwrap
def test_ray_pool_runs_programs_in_actors(monkeypatch):
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("Ray already initialised in this process")
    from pettingflow.envs.sandbox import RaySandboxPool

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")  # token auth: the session's (conftest.ray_token_auth)
    with RaySandboxPool(_settings(), num_workers=2, init_if_needed=True, num_cpus=1) as pool:
        assert isinstance(pool, Sandbox)
        good = pool.run("import sys\nprint(sys.stdin.read() * 2)", stdin="ab")
        assert good.passed and good.stdout == "abab\n"
        bad = pool.run("assert False, 'nope'")
        assert bad.exit_code == 1 and "AssertionError: nope" in bad.stderr

        async def both():
            return await asyncio.gather(pool.run_async("print(1)"), pool.run_async("while True: pass", timeout_s=1))

        fast, slow = asyncio.run(both())
        assert fast.passed and fast.stdout == "1\n"
        assert slow.timed_out and slow.killed_reason == "timeout"
    assert not ray.is_initialized()
