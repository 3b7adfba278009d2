"""Step 1 of an iteration (and validation): which tasks, which weights, then commit the episodes' rows.

Running the episodes is the rollout's (``rollout.runner.EpisodeRunner``: in this process or in Ray actors,
as ``rollout.workers`` says); this module decides what they run on and what gets committed. Everything the
rollout needs from the outside world arrives as a ``PolicyEndpoint`` per policy (a URL, the served model
name, the adapter names, the model folder for the tokenizer): plain data, so a Prefect task can take it as a
parameter and a re-run can see exactly what was used.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pettingflow.configs.settings import ExperimentConfig
from pettingflow.envs import EnvCache, load_tasks
from pettingflow.rollout.engine import EngineStats
from pettingflow.rollout.records import EpisodeRecord, build_rows
from pettingflow.rollout.runner import EpisodeRunner, LocalEpisodeRunner, Sampling
from pettingflow.runs.context import IterationContext
from pettingflow.runs.endpoint import PolicyEndpoint
from pettingflow.runs.lineage import stale_rollouts, start_version
from pettingflow.steps.outcome import StepOutcome, already_done
from pettingflow.storage import Step, StepName, TrajectoryShards, write_trajectories
from pettingflow.storage.fs import is_local

if TYPE_CHECKING:
    from pettingflow.runs.runtime import RunServices

log = logging.getLogger(__name__)


def select_train_tasks(config: ExperimentConfig, iteration: int) -> list[dict[str, Any]]:
    """``tasks_per_iteration`` tasks of the train split for ``iteration``.

    The split is shuffled once with ``run.seed`` and walked in order, wrapping around, so every task
    is seen once per epoch and the choice for an iteration is reproducible (re-runs, resume).
    """
    train = load_tasks(config.env.dataset, config.env.class_path).train
    if not train:
        raise ValueError("the train split is empty; lower env.dataset.validation_fraction")
    order = list(range(len(train)))
    random.Random(config.run.seed).shuffle(order)
    n = config.env.tasks_per_iteration
    start = iteration * n
    return [train[order[(start + i) % len(order)]] for i in range(n)]


def select_validation_tasks(config: ExperimentConfig) -> list[dict[str, Any]]:
    """The first ``validation.num_tasks`` of the validation split: the same set at every evaluation."""
    return list(load_tasks(config.env.dataset, config.env.class_path).validation[: config.validation.num_tasks])


def task_id(task: dict[str, Any], index: int) -> str:
    """A task's id for reports, for bare tasks and env rows (``task_data``) alike."""
    data = task.get("task_data", task)
    return str(data.get("task_id", index))


def stats_metrics(stats: EngineStats) -> dict[str, Any]:
    """Engine stats as plain JSON."""
    return {
        "episodes": stats.episodes,
        "turns": stats.turns,
        "tokens_generated": stats.tokens_generated,
        "wall_s": round(stats.wall_s, 3),
        "llm_s": round(stats.llm_s, 3),
        "env_s": round(stats.env_s, 3),
        "tokens_per_s": round(stats.tokens_generated / stats.wall_s, 2) if stats.wall_s else 0.0,
        "agents": stats.per_agent,
        "outcomes": stats.outcomes,  # how the episodes ended: solved, failed, max_turns, not_finished
        **({"lookahead_tokens": stats.lookahead_tokens} if stats.lookahead_tokens else {}),
        **({"envs": stats.per_env} if len(stats.per_env) > 1 else {}),  # a mixed-env step, split by env
    }


def collect_step(
    ctx: IterationContext,
    config: ExperimentConfig,
    endpoints: dict[str, PolicyEndpoint],
    *,
    env_cache: EnvCache | None = None,
    limit: int | None = None,
    show_progress: bool = True,
    policy_versions: dict[str, int] | None = None,
) -> StepOutcome:
    """Collect the iteration's rollouts (``env.group_size`` episodes per task; tree mode: one tree episode of
    ``rollout.tree.branches`` candidates per turn per task) and commit them as ``rollouts``.

    ``policy_versions``: policy -> version of the weights its server serves (rows record it); None: the
    iteration's own (sync rollouts).

    Each group (the G episodes of one task) is committed as a shard the moment its last episode ends
    (``TrajectoryShards``), so a crash mid-rollout keeps the finished groups: the next attempt collects
    only the missing ones, with the same seeds and UIDs, and commits the step once from all shards.

    ``rollout.workers: ray``: the groups run in Ray actors (``EpisodeRunner.for_config``); this process commits
    each group the moment an actor returns it, so the shards, the resume and the rows are the same as above.
    """
    step = ctx.step(StepName.ROLLOUTS)
    if done := already_done(step):
        return done
    started_at = time.time()
    tasks = select_train_tasks(config, ctx.iteration)[: limit or None]
    group_size = config.env.group_size  # episodes per task (1 in tree mode, docs/rl.md)
    shards = TrajectoryShards(step)
    stored = shards.committed()
    resumed = len(stored)
    if stored:
        log.info(
            "rollouts of iteration %d: %d of %d groups were committed by an earlier attempt; collecting the other %d",
            ctx.iteration,
            len(stored),
            len(tasks),
            len(tasks) - len(stored),
        )

    def commit_group(group: list[EpisodeRecord]) -> None:  # one task's episodes, by sample_idx
        env_idx = group[0].id.env_idx
        rows = build_rows(
            group, config.env.sample_layout, ctx.layout.run_id, ctx.iteration, group_size, policy_versions
        )
        stored[env_idx] = shards.write(env_idx, rows)

    runner = EpisodeRunner.for_config(config, endpoints, env_cache=env_cache, show_progress=show_progress)
    sampling = Sampling(
        group_size=group_size,
        # seeds follow run.seed and the iteration only (not the run id, which holds the clock): a config
        # reproduces its samples, and tests do not depend on when they run
        seed_namespace=f"iter-{ctx.iteration}/",
        tree_branches=config.rollout.tree.branches if config.rollout.mode == "tree" else None,
    )
    ran = runner.run(
        tasks,
        sampling,
        skip_groups=set(stored),
        on_group=commit_group,
    )
    metrics = stats_metrics(ran.stats)
    if ran.workers is not None:  # which actor (pid, Ray node) ran which groups of this attempt
        metrics["workers"] = ran.workers
    metrics["tasks"] = [task_id(t, i) for i, t in enumerate(tasks)]
    metrics["samples_per_task"] = group_size  # with tasks: the episodes asked for (analysis/outcomes.py)
    metrics["layout"] = config.env.sample_layout
    metrics["mode"] = config.rollout.mode
    # groups stored by an earlier attempt: their rows are in the step, their engine statistics are not
    metrics["groups_resumed"] = resumed
    metrics["started_at"], metrics["finished_at"] = started_at, time.time()  # wall clock: overlap with the update
    manifest = shards.commit(stored, metadata=metrics)
    return StepOutcome(step.name, step.uri, manifest.rows, False, metrics)


def rollouts_step(
    ctx: IterationContext,
    config: ExperimentConfig,
    runtime: RunServices,
    *,
    ahead: bool = False,
    warn: Callable[[str], Any] = log.warning,
) -> StepOutcome:
    """Step 1 as a run takes it: make the servers serve the weights this iteration samples with, then collect.

    ``runtime``: the run's ``Runtime`` (servers, env cache). ``ahead`` (``rollout.async_rollouts``): collected
    while the previous iteration's update trains, with the weights that iteration started from (rows record
    their version). Rollouts committed earlier that are too old for ``rollout.max_policy_lag`` (possible
    only after a crash) are set aside, said through ``warn``, and collected again.
    """
    step = ctx.step(StepName.ROLLOUTS)
    if not ahead and step.is_committed():  # the start versions (commit markers, S3 reads) only when there is a verdict
        starts = {p: start_version(ctx.layout, p, ctx.iteration) for p in runtime.services}
        if reason := stale_rollouts(ctx, config, starts):
            warn(f"{reason}: collecting them again (the old ones moved to {set_aside(step)})")
    if not step.is_committed():
        runtime.serve_start_of(ctx.layout, ctx.iteration - 1 if ahead else ctx.iteration)
    return collect_step(
        ctx, config, runtime.endpoints(), env_cache=runtime.env_cache, policy_versions=runtime.served_versions()
    )


def baseline_step(ctx: IterationContext, config: ExperimentConfig, runtime: RunServices) -> StepOutcome:
    """``validation_step`` on the weights ``ctx.iteration`` starts from (the base model at iteration 0), before
    any update (``validation.at_start``): the first point of the run's validation curve, committed as
    ``baseline``."""
    if not ctx.step(StepName.BASELINE).is_committed():
        runtime.serve_start_of(ctx.layout, ctx.iteration)
    return validation_step(
        ctx,
        config,
        runtime.endpoints(),
        env_cache=runtime.env_cache,
        step_name=StepName.BASELINE,
        policy_versions=runtime.served_versions(),
    )


def set_aside(step: Step) -> str:
    """Move a committed step out of the way (``<name>.stale-<n>``), kept for inspection; returns its new URI.

    Locally a rename (atomic). An object store has no rename (and s3fs's ``mv`` of a folder fails): the files are
    copied, then the original's marker is deleted before its files, so a crash midway never leaves a committed
    step with files missing (at worst two copies, and the next attempt sets the original aside again)."""
    n = 0
    while step.fs.exists(f"{step.path}.stale-{n}"):
        n += 1
    target = f"{step.path}.stale-{n}"
    if is_local(step.fs):
        step.fs.mv(step.path, target, recursive=True)
    else:
        step.fs.copy(step.path, target, recursive=True)
        step.fs.rm(step.marker_path)
        step.fs.rm(step.path, recursive=True)
    return Step(step.fs, target).uri


def validation_step(
    ctx: IterationContext,
    config: ExperimentConfig,
    endpoints: dict[str, PolicyEndpoint],
    *,
    env_cache: EnvCache | None = None,
    step_name: str = StepName.VALIDATION,
    show_progress: bool = True,
    policy_versions: dict[str, int] | None = None,
    tasks: list[dict[str, Any]] | None = None,
) -> StepOutcome:
    """``validation.samples_per_task`` episodes per held-out task at ``validation.temperature`` (default: one,
    greedy); success rate per agent. The seeds depend only on the task, so two evaluations of different
    weights see the same sampling seeds (a paired comparison).

    ``tasks``: other tasks than the held-out ones (``pettingflow eval --split/--tasks``, ``pettingflow play``),
    scored by this same code so that every evaluation counts its episodes alike."""
    step = ctx.step(step_name)
    if done := already_done(step):
        return done
    tasks = select_validation_tasks(config) if tasks is None else tasks
    # always in this process, whatever rollout.workers says: a few held-out tasks, committed as one step
    runner = LocalEpisodeRunner(config, endpoints, env_cache=env_cache, show_progress=show_progress)
    sampling = Sampling(
        config.validation.samples_per_task, f"{StepName.VALIDATION}/", temperature=config.validation.temperature
    )
    ran = runner.run(tasks, sampling)
    return _commit(
        step, ran.records, config, ctx, config.validation.samples_per_task, ran.stats, tasks, policy_versions
    )


def _commit(
    step: Step,
    records: list[Any],
    config: ExperimentConfig,
    ctx: IterationContext,
    group_size: int,
    stats: EngineStats,
    tasks: list[dict[str, Any]],
    policy_versions: dict[str, int] | None,
) -> StepOutcome:
    rows = build_rows(records, config.env.sample_layout, ctx.layout.run_id, ctx.iteration, group_size, policy_versions)
    metrics = stats_metrics(stats)
    metrics["tasks"] = [task_id(t, i) for i, t in enumerate(tasks)]
    metrics["samples_per_task"] = group_size  # with tasks: the episodes asked for (analysis/outcomes.py)
    metrics["layout"] = config.env.sample_layout
    manifest = write_trajectories(step, rows, metadata=metrics)
    return StepOutcome(step.name, step.uri, manifest.rows, False, metrics)
