"""Merging queued code-env evaluations into one sandbox run (``SandboxBatcher``).

The fake-sandbox tests check the scheduling: a call that finds a free slot runs alone, calls that queue
behind busy slots share fewer runs, and every caller gets exactly the results a run of its own gives.
The ``sandbox`` tests run merged programs in the real sandbox with episodes that misbehave (leave files
and processes behind, kill the harness, hang) and check that no other episode's result changes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_code_env import BUGGY_CODE, GOOD_CODE, TOY_TASK, FakeSandbox

from pettingflow.configs.settings import SandboxSettings
from pettingflow.envs.code_env import (
    CodeEnv,
    Job,
    SandboxBatcher,
    build_program,
    generated_suite,
    parse_ground_truth,
    read_program_spec,
)


class SlowFakeSandbox(FakeSandbox):
    """A fake whose runs take a while, so that calls queue behind busy slots; records runs in flight."""

    def __init__(self, delay_s: float = 0.02, **kwargs: Any):
        super().__init__(**kwargs)
        self.delay_s = delay_s
        self.in_flight = self.peak = 0
        self.timeouts: list[float | None] = []

    async def run_async(self, code: str, *, stdin: str = "", timeout_s: float | None = None):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        self.timeouts.append(timeout_s)
        try:
            await asyncio.sleep(self.delay_s)
            return self.run(code, stdin=stdin, timeout_s=timeout_s)
        finally:
            self.in_flight -= 1


def envs(sandbox: Any, n: int, max_concurrency: int = 2, **sandbox_settings: Any) -> list[CodeEnv]:
    settings = SandboxSettings(max_concurrency=max_concurrency, **sandbox_settings).model_dump()
    return [CodeEnv(TOY_TASK, {"max_turns": 2, "sandbox": settings}, sandbox=sandbox) for _ in range(n)]


def outcome(ev: Any) -> tuple[Any, ...]:
    return (ev.ground_truth.flags(), [c.error for c in ev.ground_truth.cases], ev.ground_truth.setup_error)


def test_a_call_with_a_free_slot_runs_alone_as_before() -> None:
    sandbox = SlowFakeSandbox()
    [env] = envs(sandbox, 1)
    ev = asyncio.run(env.submit_code(GOOD_CODE))
    assert ev.ground_truth.all_passed
    spec = read_program_spec(sandbox.programs[0])
    assert "groups" not in spec and len(spec["jobs"]) == 1
    assert sandbox.timeouts == [None]  # the sandbox's own limit, as before


def test_queued_calls_are_merged_and_get_the_results_of_runs_of_their_own() -> None:
    codes = [GOOD_CODE, BUGGY_CODE, "def add(a, b):\n    return 0", GOOD_CODE] * 5  # 20 episodes

    async def together(sandbox: SlowFakeSandbox) -> list[Any]:
        return await asyncio.gather(*(e.submit_code(c) for e, c in zip(envs(sandbox, len(codes)), codes, strict=True)))

    async def one_by_one(sandbox: SlowFakeSandbox) -> list[Any]:
        return [await e.submit_code(c) for e, c in zip(envs(sandbox, len(codes)), codes, strict=True)]

    merged, alone = SlowFakeSandbox(), SlowFakeSandbox()
    got, expected = asyncio.run(together(merged)), asyncio.run(one_by_one(alone))
    assert [outcome(e) for e in got] == [outcome(e) for e in expected]
    assert len(alone.programs) == 20
    # the first two calls find free slots; the 18 queued ones are shared by the two slots as they free
    # (the first to free takes an even share of the 19 episodes not done yet, the other the rest)
    assert len(merged.programs) == 4
    assert merged.peak == 2  # never more runs in flight than sandbox.max_concurrency
    groups = [read_program_spec(p).get("groups") for p in merged.programs]
    assert groups[:2] == [None, None]
    assert [len(g) for g in groups[2:]] == [10, 8]
    budget = 10.0 * 0.7  # sandbox.timeout_s * budget_fraction, per episode
    assert all(g == [[1, budget]] * len(g) for g in groups[2:])
    assert merged.timeouts == [None, None, 100.0, 80.0]  # timeout_s per merged episode


def test_generated_tests_and_multi_job_episodes_are_split_back_correctly() -> None:
    async def main(sandbox: SlowFakeSandbox) -> list[Any]:
        es = envs(sandbox, 6, max_concurrency=1)
        await asyncio.gather(*(e.submit_tests(["assert add(1, 1) == 2", "assert add(2, 2) == 5"]) for e in es))
        return await asyncio.gather(*(e.submit_code(GOOD_CODE if i % 2 else BUGGY_CODE) for i, e in enumerate(es)))

    got = asyncio.run(main(SlowFakeSandbox()))
    for i, ev in enumerate(got):
        assert ev.generated_tests is not None
        assert ev.generated_tests.flags() == ([True, False] if i % 2 else [False, False])
        assert ev.ground_truth.all_passed == bool(i % 2)


def test_a_sandbox_error_reaches_every_caller_of_the_merged_run() -> None:
    class Broken(SlowFakeSandbox):
        async def run_async(self, code: str, *, stdin: str = "", timeout_s: float | None = None):
            await asyncio.sleep(0.01)
            raise RuntimeError("sandbox infrastructure down")

    async def main() -> list[Any]:
        es = envs(Broken(), 5, max_concurrency=1)
        return await asyncio.gather(*(e.submit_code(GOOD_CODE) for e in es), return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) for r in results)


def test_a_merged_run_without_a_summary_falls_back_to_runs_of_their_own() -> None:
    class DropsMerged(SlowFakeSandbox):
        def run(self, code: str, *, stdin: str = "", timeout_s: float | None = None):
            if "groups" in read_program_spec(stdin):
                self.programs.append(stdin)
                from test_code_env import FakeExecResult

                return FakeExecResult(None, False, "", killed_reason="signal:SIGKILL")
            return super().run(code, stdin=stdin, timeout_s=timeout_s)

    sandbox = DropsMerged()

    async def main() -> list[Any]:
        es = envs(sandbox, 4, max_concurrency=1)
        return await asyncio.gather(*(e.submit_code(GOOD_CODE) for e in es))

    got = asyncio.run(main())
    assert all(ev.ground_truth.all_passed for ev in got)
    merged = [p for p in sandbox.programs if "groups" in read_program_spec(p)]
    assert len(merged) == 1 and len(sandbox.programs) == 1 + 1 + 3  # alone, merged (3), then 3 alone


def test_batchers_are_per_event_loop_and_sandbox() -> None:
    sandbox = SlowFakeSandbox()
    [env] = envs(sandbox, 1)

    async def get() -> SandboxBatcher:
        return SandboxBatcher.get(env.sandbox, env.config)

    assert asyncio.run(get()) is not asyncio.run(get())

    async def same_loop() -> bool:
        return SandboxBatcher.get(env.sandbox, env.config) is SandboxBatcher.get(env.sandbox, env.config)

    assert asyncio.run(same_loop())


def test_groups_must_partition_the_jobs() -> None:
    job = Job(GOOD_CODE, "add", generated_suite(["assert add(1, 1) == 2"], "add"))
    with pytest.raises(ValueError, match="partition"):
        build_program([job, job], case_timeout_s=1.0, budget_s=1.0, groups=[1])


# --------------------------------------------------------------------------------------------------
# the real sandbox
# --------------------------------------------------------------------------------------------------
LEAVES_A_FILE = "open('/tmp/leak', 'w').write('x')\nopen('leak', 'w').write('x')\ndef add(a, b):\n    return a + b"
SEES_A_FILE = (
    "import os\ndef add(a, b):\n"
    "    return a + b + (100 if os.path.exists('/tmp/leak') or os.path.exists('leak') else 0)"
)
LEAVES_A_PROCESS = (  # a daemon that lets go of the harness's pipes, then kills everything it can
    "import os, signal, time\n"
    "if os.fork() == 0:\n    os.closerange(3, 4096)\n    time.sleep(0.5)\n    os.kill(-1, signal.SIGKILL)\n"
    "    os._exit(0)\n"
    "def add(a, b):\n    return a + b"
)
SLOW = "import time\ndef add(a, b):\n    time.sleep(0.3)\n    return a + b"
KILLS_THE_HARNESS = "import os, signal\nos.kill(-1, signal.SIGKILL)\ndef add(a, b):\n    return a + b"  # judge too
HANGS = "def add(a, b):\n    while True:\n        pass"
STOPS_ITS_PARENT = (
    "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\ndef add(a, b):\n    return a + b"  # zygote
)


def real_envs(n: int, max_concurrency: int = 1) -> list[CodeEnv]:
    from pettingflow.envs.sandbox import make_sandbox

    # passing cases (SLOW's take 0.3 s each) get a limit a loaded machine does not reach; hanging ones still time out
    settings = SandboxSettings(timeout_s=10, max_concurrency=max_concurrency)
    sandbox = make_sandbox(settings)
    config = {"max_turns": 2, "sandbox": settings.model_dump(), "case_timeout_s": 2.0}
    return [CodeEnv(TOY_TASK, config, sandbox=sandbox) for _ in range(n)]


def compare_merged_with_alone(codes: list[str]) -> tuple[list[Any], SandboxBatcher]:
    async def together() -> tuple[list[Any], SandboxBatcher]:
        es = real_envs(len(codes))
        batcher = SandboxBatcher.get(es[0].sandbox, es[0].config)
        got = await asyncio.gather(*(e.submit_code(c) for e, c in zip(es, codes, strict=True)))
        return got, batcher

    async def one_by_one() -> list[Any]:
        return [await e.submit_code(c) for e, c in zip(real_envs(len(codes)), codes, strict=True)]

    got, batcher = asyncio.run(together())
    expected = asyncio.run(one_by_one())
    assert [outcome(e) for e in got] == [outcome(e) for e in expected]
    return got, batcher


@pytest.mark.sandbox
def test_real_merged_run_leftover_files_and_processes_do_not_reach_the_next_episode() -> None:
    # the first call runs alone; the other five are merged into one run (one slot)
    codes = [GOOD_CODE, LEAVES_A_FILE, SEES_A_FILE, LEAVES_A_PROCESS, SLOW, SEES_A_FILE, STOPS_ITS_PARENT, GOOD_CODE]
    got, batcher = compare_merged_with_alone(codes)
    assert batcher.runs == 2  # no fallback: the daemon was gone before the slow episode ran
    assert all(ev.ground_truth.all_passed for ev in got)


@pytest.mark.sandbox
def test_real_merged_run_killed_by_one_episode_reruns_each_on_its_own() -> None:
    codes = [GOOD_CODE, GOOD_CODE, KILLS_THE_HARNESS, BUGGY_CODE]
    got, batcher = compare_merged_with_alone(codes)
    assert batcher.runs == 2 + 3  # alone, merged (no summary), then each of the three again
    assert got[1].ground_truth.all_passed and not got[2].ground_truth.all_passed
    assert got[3].ground_truth.passed == 1  # add(0, 0) == 0


@pytest.mark.sandbox
def test_real_merged_run_each_episode_has_its_own_time_budget() -> None:
    codes = [GOOD_CODE, HANGS, GOOD_CODE, HANGS, GOOD_CODE]
    got, batcher = compare_merged_with_alone(codes)
    assert batcher.runs == 2
    assert [ev.ground_truth.all_passed for ev in got] == [True, False, True, False, True]
    assert all("timed out" in (c.error or "") for c in got[1].ground_truth.cases)


def test_ground_truth_suite_in_merged_program_is_per_job() -> None:
    suite = parse_ground_truth(TOY_TASK["test"])
    jobs = [Job(GOOD_CODE, "add", suite), Job(BUGGY_CODE, "add", suite)]
    spec = read_program_spec(build_program(jobs, case_timeout_s=1.0, budget_s=2.0, groups=[1, 1]).stdin)
    assert spec["groups"] == [[1, 2.0], [1, 2.0]] and len(spec["jobs"]) == 2
