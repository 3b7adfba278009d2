"""The program that runs in the sandbox: it evaluates a list of jobs and prints one summary line.

``program.build_program`` sends this file's text, with the placeholder string of ``SPEC_JSON`` replaced
by the spec, as the sandbox's main program. Run as ``__main__`` it evaluates the jobs; imported (the unit
tests do) it only defines functions. So it must stay stdlib-only and importable by the sandbox's system
``python3``, which may be older than the project's: no ``match``, no ``zip(strict=)``, and annotations
stay strings (``from __future__ import annotations``).

The harness never executes model code itself (unless fork fails): each job runs in a forked child whose
stdout/stderr go to /dev/null, so model code cannot flood or forge the summary, and a crash or hang loses
only that job's remaining cases. Each assert runs separately under a per-case time limit (``SIGALRM``).

Never run ``main`` or ``clean_slate`` outside a sandbox: between merged episodes ``clean_slate`` kills
every process it may signal and empties the working folder, /tmp and /dev/shm.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import select
import signal
import time
from collections.abc import Callable
from typing import Any

#: The spec (a JSON text) as a string literal: ``build_program`` replaces the literal, quotes included.
SPEC_JSON = "__PETTINGFLOW_SPEC__"


class _Timeout(BaseException):
    """Raised by the alarm; a BaseException so that ``except Exception`` in model code does not catch it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Timeout()


def describe(exc: BaseException) -> str:
    """A short error text for a case: the exception's type and message, cut at 300 characters."""
    if isinstance(exc, _Timeout):
        return "timed out"
    text = type(exc).__name__
    msg = str(exc)
    if msg:
        text += ": " + msg
    return text[:300]


def left_value(source: str, ns: dict[str, Any], deadline: float) -> str:
    """For a failed ``assert lhs <op> rhs``: `` (left side was <repr>)``, else "" (the code agent sees it)."""
    try:
        node = ast.parse(source).body[0]
        if not (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare)):
            return ""
        expr = ast.fix_missing_locations(ast.Expression(node.test.left))
        signal.setitimer(signal.ITIMER_REAL, max(0.01, min(0.5, deadline - time.monotonic())))
        try:
            value = eval(compile(expr, "<detail>", "eval"), ns)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        return " (left side was " + repr(value)[:150] + ")"
    except BaseException:
        return ""


def run_job(job: dict[str, Any], deadline: float, emit: Callable[[dict[str, Any]], Any], case_timeout_s: float) -> None:
    """Load the job's solution, then run its steps; ``emit`` gets ``{"setup_error"}`` then one record per case.

    Runs model code in this process: the harness calls it in a forked child (``run_forked``).
    """
    signal.signal(signal.SIGALRM, _on_alarm)
    ns: dict[str, Any] = {"__name__": "__pettingflow_solution__"}

    def timed(source: str, name: str) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Timeout()
        signal.setitimer(signal.ITIMER_REAL, min(case_timeout_s, left))
        try:
            exec(compile(source, name, "exec"), ns)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    entry = job["entry_point"]
    setup_error = None
    try:
        if job["context"]:
            with contextlib.suppress(Exception):  # a prompt that fails to run still defines what it can
                timed(job["context"], "<prompt>")
            ns.pop(entry, None)
        timed(job["solution"], "<solution>")
        if not callable(ns.get(entry)):
            setup_error = "the solution does not define a function named " + entry
    except BaseException as exc:
        setup_error = "the solution failed to load: " + describe(exc)
    if setup_error is None:
        try:
            if job["preamble"]:
                timed(job["preamble"], "<test setup>")
            if job["candidate_name"]:
                ns[job["candidate_name"]] = ns[entry]
        except BaseException as exc:
            setup_error = "the test setup failed: " + describe(exc)
    emit({"setup_error": setup_error})
    for i, step in enumerate(job["steps"]):
        if setup_error is not None:
            if step["case"]:
                emit({"i": i, "ok": False, "error": setup_error})
            continue
        ok, error = True, None
        try:
            try:
                timed(step["source"], f"<test {i}>")
            except AssertionError as exc:
                ok, error = False, describe(exc) + left_value(step["source"], ns, deadline)
            except BaseException as exc:
                ok, error = False, describe(exc)
        except BaseException as exc:  # the alarm fired while describing the failure
            ok, error = False, describe(exc)
        if step["case"]:
            emit({"i": i, "ok": ok, "error": error})


def run_forked(job: dict[str, Any], deadline: float, case_timeout_s: float, null_fd: int) -> list[str] | None:
    """``run_job`` in a child (stderr on ``null_fd``), killed at ``deadline + 0.25``: its JSON lines, or None
    when fork failed."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return None
    if pid == 0:
        try:
            os.close(r)
            os.dup2(null_fd, 2)
            run_job(job, deadline, lambda obj: os.write(w, (json.dumps(obj) + "\n").encode()), case_timeout_s)
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while True:
        left = deadline + 0.25 - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([r], [], [], left)
        if not ready:
            continue
        data = os.read(r, 65536)
        if not data:
            break
        chunks.append(data)
    os.close(r)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode("utf-8", "replace").splitlines()


def run_inline(job: dict[str, Any], deadline: float, case_timeout_s: float) -> list[str]:
    """``run_job`` in this process, its records as JSON lines: the fallback when fork fails."""
    lines: list[str] = []
    run_job(job, deadline, lambda obj: lines.append(json.dumps(obj)), case_timeout_s)
    return lines


def collect(job: dict[str, Any], lines: list[str], deadline: float) -> dict[str, Any]:
    """The job's summary entry ``{"setup_error", "cases": [[ok, error], ...]}`` from its records; a case with
    no record failed (time budget used up, or the child died before it)."""
    setup_error, got = None, {}
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if "setup_error" in obj:
            setup_error = obj["setup_error"]
        elif "i" in obj:
            got[obj["i"]] = obj
    if time.monotonic() >= deadline:
        missing = "timed out (time budget of this run used up)"
    else:
        missing = "the test process died before reaching this case"
    cases = []
    for i, step in enumerate(job["steps"]):
        if step["case"]:
            rec = got.get(i)
            cases.append([bool(rec["ok"]), rec.get("error")] if rec else [False, missing])
    return {"setup_error": setup_error, "cases": cases}


def run_group(
    jobs: list[dict[str, Any]], budget_s: float, results: list[dict[str, Any]], case_timeout_s: float, null_fd: int
) -> None:
    """Run ``jobs`` one after the other within ``budget_s``, appending one summary entry per job to ``results``.

    Each job's deadline is its share of the time left, in proportion to its case count.
    """
    end = time.monotonic() + budget_s
    counts = [sum(1 for s in j["steps"] if s["case"]) for j in jobs]
    remaining = sum(counts)
    for job, n in zip(jobs, counts):  # noqa: B905 (strict= needs Python 3.10; equal lengths by construction)
        now = time.monotonic()
        share = (end - now) * n / remaining if remaining else 0.0
        remaining -= n
        deadline = now + max(share, 0.0)
        lines = run_forked(job, deadline, case_timeout_s, null_fd)
        if lines is None:
            lines = run_inline(job, deadline, case_timeout_s)
        results.append(collect(job, lines, deadline))


def clean_slate() -> None:
    """Between the episodes of a merged run: what one left behind must not reach the next, as if each had
    its own sandbox. Kill every other process we may signal (not us, not the namespace's init), then
    empty the scratch folders. Only ever inside the sandbox."""
    import shutil

    with contextlib.suppress(OSError):
        os.kill(-1, signal.SIGKILL)
    for root in (os.getcwd(), "/tmp", "/dev/shm"):
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            path = os.path.join(root, name)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
            except OSError:
                pass


def main(spec: dict[str, Any]) -> None:
    """Evaluate every job of ``spec`` (group by group) and write ``marker + json(results)`` to the real stdout.

    fds 0 and 1 go to /dev/null first, so nothing but the summary reaches stdout.
    """
    out = os.dup(1)
    null_fd = os.open(os.devnull, os.O_RDWR)
    os.dup2(null_fd, 0)
    os.dup2(null_fd, 1)
    jobs = spec["jobs"]
    groups = spec.get("groups") or [[len(jobs), spec["budget_s"]]]
    results: list[dict[str, Any]] = []
    start = 0
    for g, (n, budget_s) in enumerate(groups):
        if g:
            clean_slate()
        run_group(jobs[start : start + n], budget_s, results, spec["case_timeout_s"], null_fd)
        start += n
    os.write(out, (spec["marker"] + json.dumps(results) + "\n").encode())


if __name__ == "__main__":
    main(json.loads(SPEC_JSON))
