"""What the reward boundary costs: the code env's evaluation per episode with the judge/runner harness vs the
single-process harness it replaced, side by side in one run, and HumanEval's canonical solutions on the new one.

Why: the judge/runner split (docs/sandbox.md, "Reward integrity") starts a fresh interpreter per job where the
old harness forked, and sends every call across a socket. This measures what that costs where it is paid: one
sandbox run per agent turn, as the code env makes them (a code turn = the solution on the ground truth and on
the latest generated tests; a test turn = the tests on the canonical solution and on the code).

Method: N basic-python tasks (or HumanEval with ``--dataset humaneval``); per task one episode of two turns
(the canonical solution as the code, 4 generated asserts as the tests), each turn one sandbox run of the real
bubblewrap sandbox. The old harness is read from git (``--old-ref``, default the commit before the split) and
fed the same jobs; each turn runs on both back to back, the order alternating from turn to turn; the figure is
the median over rounds of (new / old) wall time per episode. ``--check-humaneval`` also scores HumanEval's 164
canonical solutions on the new harness (one run).

    .venv/bin/python -m bench.reward_boundary [--tasks 20] [--rounds 5] [--check-humaneval]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench import common
from pettingflow.configs.settings import SandboxSettings
from pettingflow.envs.basic_python import load_basic_python
from pettingflow.envs.code_env import Job, build_program, generated_suite, new_marker, parse_ground_truth
from pettingflow.envs.code_env.program import Program
from pettingflow.envs.code_env.results import parse_program_output
from pettingflow.envs.humaneval import load_humaneval
from pettingflow.envs.sandbox import ExecResult, make_sandbox

OLD_REF = "147bd45"  # main before the judge/runner split
CASE_TIMEOUT_S = 5.0
BUDGET_S = 60.0


def old_harness(ref: str) -> str:
    """The single-process harness of ``ref`` (its spec goes in place of a placeholder string)."""
    text = subprocess.run(
        ["git", "show", f"{ref}:envs/code_env/harness.py"], cwd=common.REPO, capture_output=True, text=True, check=True
    ).stdout
    if text.count('"__PETTINGFLOW_SPEC__"') != 1:
        raise SystemExit(f"{ref}:envs/code_env/harness.py is not the old single-process harness")
    return text


def old_program(
    harness: str,
    jobs: list[Job],
    marker: str,
    case_timeout_s: float = CASE_TIMEOUT_S,
    budget_s: float = BUDGET_S,
    groups: Sequence[int] | None = None,
) -> str:
    spec: dict[str, Any] = {
        "marker": marker,
        "case_timeout_s": case_timeout_s,
        "budget_s": budget_s,
        "jobs": [j.to_json() for j in jobs],  # old harness: runs each step's "source"
    }
    if groups is not None:
        spec["groups"] = [[n, budget_s] for n in groups]
    return harness.replace('"__PETTINGFLOW_SPEC__"', repr(json.dumps(spec)), 1)


def as_per_job_lines(result: ExecResult, marker: str) -> ExecResult:
    """The old harness's one summary line rewritten as the new one's ``marker + [index, result]`` lines."""
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(marker):
            try:
                entries = json.loads(line[len(marker) :])
            except ValueError:
                break
            lines = [marker + json.dumps([i, e]) for i, e in enumerate(entries)]
            return dataclasses.replace(result, stdout="\n".join(lines) + "\n")
    return result


@contextlib.contextmanager
def old_harness_in_code_env(ref: str = OLD_REF) -> Iterator[None]:
    """Within the block, the code env's sandbox evaluations (``code_env.batching``, merged runs included) run on
    the old single-process harness of ``ref``: for ``bench/rollout.py --old-harness``, the same rollouts timed
    on both sides of the reward boundary."""
    from pettingflow.envs.code_env import batching

    harness = old_harness(ref)
    saved = (batching.build_program, batching.parse_program_output, batching.complete_summary)

    def build(jobs: Sequence[Job], *, case_timeout_s: float, budget_s: float, marker: str | None = None, groups=None):
        marker = marker or new_marker()
        code = old_program(harness, list(jobs), marker, case_timeout_s, budget_s, groups)
        return Program(code, "")

    batching.build_program = build
    batching.parse_program_output = lambda result, jobs, marker: saved[1](
        as_per_job_lines(result, marker), jobs, marker
    )
    batching.complete_summary = lambda result, marker, n: saved[2](as_per_job_lines(result, marker), marker, n)
    try:
        yield
    finally:
        batching.build_program, batching.parse_program_output, batching.complete_summary = saved


def old_results(stdout: str, marker: str, n: int) -> list[list[bool]]:
    for line in reversed(stdout.splitlines()):
        if line.startswith(marker):
            return [[bool(ok) for ok, _ in job["cases"]] for job in json.loads(line[len(marker) :])]
    return [[] for _ in range(n)]


def episode_turns(task: dict[str, Any]) -> list[list[Job]]:
    """The two turns of one episode, as the code env builds their jobs."""
    entry, prompt = task["entry_point"], task["prompt"]
    code = prompt + task["canonical_solution"]
    truth = parse_ground_truth(task["test"])
    generated = [c for c in truth.cases if c.startswith("assert ") and "\n" not in c][:4] or [f"assert {entry}()"]
    tests = generated_suite(generated, entry)
    code_turn = [Job(code, entry, truth, context=prompt), Job(code, entry, tests, context=prompt)]
    test_turn = [Job(code, entry, tests, context=prompt), Job(code, entry, tests, context=prompt)]
    return [code_turn, test_turn]


def run_turn(sandbox: Any, jobs: list[Job], harness_text: str | None) -> tuple[float, list[list[bool]]]:
    marker = new_marker()
    t0 = time.perf_counter()
    if harness_text is None:
        program = build_program(jobs, case_timeout_s=CASE_TIMEOUT_S, budget_s=BUDGET_S, marker=marker)
        result = sandbox.run(program.code, stdin=program.stdin)
        flags = [r.flags() for r in parse_program_output(result, jobs, marker)]
    else:
        result = sandbox.run(old_program(harness_text, jobs, marker))
        flags = old_results(result.stdout, marker, len(jobs))
    return time.perf_counter() - t0, flags


def check_humaneval(sandbox: Any) -> tuple[int, int, list[str]]:
    tasks = load_humaneval()
    jobs = [
        Job(t["prompt"] + t["canonical_solution"], t["entry_point"], parse_ground_truth(t["test"]), context=t["prompt"])
        for t in tasks
    ]
    marker = new_marker()
    program = build_program(jobs, case_timeout_s=10.0, budget_s=600.0, marker=marker)
    result = sandbox.run(program.code, stdin=program.stdin, timeout_s=900)
    results = parse_program_output(result, jobs, marker)
    failed = [t["task_id"] for t, r in zip(tasks, results, strict=True) if not r.all_passed]
    return len(tasks) - len(failed), len(tasks), failed


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reward_boundary", description=__doc__)
    parser.add_argument("--tasks", type=int, default=20, help="episodes per round (default 20)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating old/new rounds (default 5)")
    parser.add_argument("--dataset", choices=["basic-python", "humaneval"], default="basic-python")
    parser.add_argument("--old-ref", default=OLD_REF, help=f"git ref of the old harness (default {OLD_REF})")
    parser.add_argument("--check-humaneval", action="store_true", help="also score HumanEval's 164 canonical ones")
    parser.add_argument("--no-wait", action="store_true", help="do not wait for a running pytest session to end")
    args = parser.parse_args(argv)
    if not args.no_wait:
        common.wait_for_quiet()
    sandbox = make_sandbox(SandboxSettings(timeout_s=120, max_concurrency=1))
    tasks = (load_basic_python() if args.dataset == "basic-python" else load_humaneval())[: args.tasks]
    turns = [episode_turns(t) for t in tasks]
    old = old_harness(args.old_ref)
    print(f"cpu: {cpu_name()}")
    print(f"{len(tasks)} {args.dataset} episodes x 2 turns per round, {args.rounds} rounds, old = {args.old_ref}")
    ratios, rows = [], []
    for r in range(args.rounds):
        totals = {"old": 0.0, "new": 0.0}
        flags: dict[str, list[Any]] = {"old": [], "new": []}
        for t, jobs in enumerate(jobs for episode in turns for jobs in episode):
            # old and new back to back on each turn, the order alternating: a load that drifts (another
            # process on a 2-core machine) hits both sides alike
            for which in ("old", "new") if (t + r) % 2 == 0 else ("new", "old"):
                dt, f = run_turn(sandbox, jobs, old if which == "old" else None)
                totals[which] += dt
                flags[which].append(f)
        times = {k: v / len(turns) for k, v in totals.items()}
        agree = flags["old"] == flags["new"]
        ratios.append(times["new"] / times["old"])
        rows.append((r + 1, times["old"], times["new"], ratios[-1], agree))
        print(
            f"round {r + 1}: old {times['old'] * 1000:.0f} ms/episode, new {times['new'] * 1000:.0f} ms/episode, "
            f"new/old {ratios[-1]:.3f}, same pass/fail per case: {agree}",
            flush=True,
        )
    print(f"\nnew / old evaluation time per episode: median {common.median(ratios):.3f} over {len(ratios)} rounds")
    if not all(row[4] for row in rows):
        print("WARNING: the two harnesses disagreed on some case (see the rounds above)", file=sys.stderr)
    if args.check_humaneval:
        passed, total, failed = check_humaneval(sandbox)
        tail = f" (failed: {failed})" if failed else ""
        print(f"HumanEval canonical solutions on the new harness: {passed}/{total} pass{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
