"""Merging queued code-env evaluations into fewer sandbox runs: the sandbox off the critical path of a round."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pettingflow.envs.code_env.program import build_program, new_marker
from pettingflow.envs.code_env.results import SuiteResult, complete_summary, parse_program_output
from pettingflow.envs.code_env.suites import Job

if TYPE_CHECKING:
    from pettingflow.envs.code_env.env import CodeEnvConfig
    from pettingflow.envs.sandbox import Sandbox

log = logging.getLogger(__name__)

#: Most episodes merged into one sandbox run. ``SandboxBatcher.get`` reads this module global at call
#: time, so an ablation can set ``pettingflow.envs.code_env.batching.MAX_MERGED_EPISODES`` (bench/rollout.py).
MAX_MERGED_EPISODES = 16


_BATCHERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[Any, ...], SandboxBatcher]] = (
    weakref.WeakKeyDictionary()
)


class SandboxBatcher:
    """Runs the evaluations of many episodes on one sandbox, merging those that wait for a free slot.

    Why: when a round's requests finish together (a one-turn workload ends every episode in the same
    decode step), 32 evaluations queue behind ``sandbox.max_concurrency`` slots, and each pays a sandbox
    start (bubblewrap, two interpreter starts: most of a run's time for a short test). The wall time of
    the round then ends with that queue, after the last token. Here a call that finds a free slot runs
    alone, exactly as before; calls that arrive while every slot is busy wait, and a slot that frees takes
    its share of the queue (at most ``MAX_MERGED_EPISODES``) as ONE program whose episodes run one after
    the other, each with its own time budget, the scratch folders emptied and leftover processes killed
    in between (``build_program(groups=...)``). The wall-clock limit of a merged run is ``timeout_s``
    per episode. If a merged run gives no complete summary (a program that killed the harness, a
    timeout), each of its episodes is run again on its own, so a misbehaving episode never changes
    another one's result.

    One batcher per (sandbox, limits, event loop): ``asyncio.run`` per round gets a fresh one.
    """

    def __init__(self, sandbox: Sandbox, config: CodeEnvConfig, slots: int, max_batch: int = MAX_MERGED_EPISODES):
        self.sandbox = sandbox
        self.config = config
        self.slots = max(1, slots)
        self.max_batch = max(1, max_batch)
        self.free = self.slots
        self.running = 0  # episodes in the runs now in flight
        self.pending: list[tuple[list[Job], asyncio.Future[list[SuiteResult]]]] = []
        self.runs = 0  # sandbox runs made (merged ones count once)
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def get(cls, sandbox: Sandbox, config: CodeEnvConfig) -> SandboxBatcher:
        loop = asyncio.get_running_loop()
        per_loop = _BATCHERS.setdefault(loop, {})
        cfg = config
        key = (id(sandbox), cfg.case_timeout_s, cfg.budget_fraction, cfg.sandbox.timeout_s)
        batcher = per_loop.get(key)
        if batcher is None or batcher.sandbox is not sandbox:
            batcher = per_loop[key] = cls(
                sandbox, config, slots=cfg.sandbox.max_concurrency, max_batch=MAX_MERGED_EPISODES
            )
        return batcher

    async def evaluate(self, jobs: Sequence[Job]) -> list[SuiteResult]:
        future: asyncio.Future[list[SuiteResult]] = asyncio.get_running_loop().create_future()
        self.pending.append((list(jobs), future))
        self._dispatch()
        return await future

    def _dispatch(self) -> None:
        self.pending = [(jobs, fut) for jobs, fut in self.pending if not fut.done()]  # drop cancelled calls
        while self.free > 0 and self.pending:
            # an even share of all the work not yet done (queued + running), so that the busy slots, which
            # free soon, get work too: 2 slots, 1 episode running and 18 queued -> 10 now, 8 at the next
            share = -(-(len(self.pending) + self.running) // self.slots)
            n = max(1, min(self.max_batch, len(self.pending), share))
            batch, self.pending = self.pending[:n], self.pending[n:]
            self.free -= 1
            self.running += n
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[list[Job], asyncio.Future[list[SuiteResult]]]]) -> None:
        try:
            if len(batch) == 1:
                results = [await self._alone(batch[0][0])]
            else:
                results = await self._merged([jobs for jobs, _ in batch])
        except Exception as exc:  # a sandbox infrastructure error reaches every caller of the batch
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
        except BaseException:  # cancelled (the loop is closing): so are the callers
            for _, fut in batch:
                fut.cancel()
            raise
        else:
            for (_, fut), res in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(res)
        finally:
            self.free += 1
            self.running -= len(batch)
            self._dispatch()

    def _budget(self) -> float:
        return self.config.sandbox.timeout_s * self.config.budget_fraction

    async def _alone(self, jobs: list[Job]) -> list[SuiteResult]:
        marker = new_marker()
        program = build_program(jobs, case_timeout_s=self.config.case_timeout_s, budget_s=self._budget(), marker=marker)
        self.runs += 1
        result = await self.sandbox.run_async(program.code, stdin=program.stdin)
        return parse_program_output(result, jobs, marker)

    async def _merged(self, groups: list[list[Job]]) -> list[list[SuiteResult]]:
        flat = [job for jobs in groups for job in jobs]
        marker = new_marker()
        program = build_program(
            flat,
            case_timeout_s=self.config.case_timeout_s,
            budget_s=self._budget(),
            marker=marker,
            groups=[len(jobs) for jobs in groups],
        )
        self.runs += 1
        result = await self.sandbox.run_async(
            program.code, stdin=program.stdin, timeout_s=self.config.sandbox.timeout_s * len(groups)
        )
        if complete_summary(result, marker, len(flat)) is None:
            log.warning(
                "a merged sandbox run of %d episodes gave no complete summary (%s); running each on its own",
                len(groups),
                result.killed_reason or f"exit code {result.exit_code}",
            )
            return [await self._alone(jobs) for jobs in groups]
        results = parse_program_output(result, flat, marker)
        out, start = [], 0
        for jobs in groups:
            out.append(results[start : start + len(jobs)])
            start += len(jobs)
        return out
