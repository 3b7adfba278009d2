"""Who runs a step's episodes: this process (one asyncio loop) or Ray rollout actors, chosen once from the config.

Both runners take the step's whole task list (a task's index fixes its seeds and UIDs), run the groups not
skipped, and hand each finished group to ``on_group`` (its episodes sorted by ``sample_idx``) the moment its last
episode ends, so the caller can commit it while the other groups still run. The records, and so the rows, do not
depend on the runner.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from pettingflow.configs.settings import ExperimentConfig
from pettingflow.envs import EnvCache
from pettingflow.rollout.engine import EngineStats
from pettingflow.rollout.local import Endpoint, Sampling, run_episodes
from pettingflow.rollout.records import EpisodeRecord

OnGroup = Callable[[list[EpisodeRecord]], None]
__all__ = ["EpisodeRunner", "LocalEpisodeRunner", "OnGroup", "RayEpisodeRunner", "RunResult", "Sampling"]


@dataclass
class RunResult:
    """The episodes a runner ran (in task, then sample order) and their statistics."""

    records: list[EpisodeRecord]
    stats: EngineStats
    workers: list[dict[str, Any]] | None = None  # Ray: per actor its pid, node and the groups it ran


class EpisodeRunner:
    """Runs groups of episodes against the policies' inference servers (``for_config`` picks the kind)."""

    @staticmethod
    def for_config(
        config: ExperimentConfig,
        endpoints: Mapping[str, Endpoint],
        *,
        env_cache: EnvCache | None = None,
        show_progress: bool = True,
    ) -> EpisodeRunner:
        """``rollout.workers``: ``local`` runs every episode in this process, ``ray`` deals the groups to
        ``rollout.num_workers`` Ray actors (each with its own env cache, so ``env_cache`` is not used)."""
        if config.rollout.workers == "ray":
            return RayEpisodeRunner(config, endpoints)
        return LocalEpisodeRunner(config, endpoints, env_cache=env_cache, show_progress=show_progress)

    def run(
        self,
        tasks: list[dict[str, Any]],
        sampling: Sampling,
        *,
        skip_groups: Collection[int] = (),
        on_group: OnGroup | None = None,
    ) -> RunResult:
        """``sampling``'s episodes of every task of ``tasks`` whose index is not in ``skip_groups``."""
        raise NotImplementedError


class LocalEpisodeRunner(EpisodeRunner):
    """Every episode on one asyncio loop in this process, over one engine."""

    def __init__(
        self,
        config: ExperimentConfig,
        endpoints: Mapping[str, Endpoint],
        *,
        env_cache: EnvCache | None = None,
        show_progress: bool = True,
    ):
        self.config = config
        self.endpoints = endpoints
        self.env_cache = env_cache or EnvCache()
        self.show_progress = show_progress

    def run(
        self,
        tasks: list[dict[str, Any]],
        sampling: Sampling,
        *,
        skip_groups: Collection[int] = (),
        on_group: OnGroup | None = None,
    ) -> RunResult:
        pending: dict[int, list[EpisodeRecord]] = {}

        def on_episode(record: EpisodeRecord) -> None:
            group = pending.setdefault(record.id.env_idx, [])
            group.append(record)
            if len(group) == sampling.group_size:
                del pending[record.id.env_idx]
                group.sort(key=lambda r: r.id.sample_idx)
                if on_group is not None:
                    on_group(group)

        records, stats = asyncio.run(
            run_episodes(
                self.config,
                self.endpoints,
                tasks,
                group_size=sampling.group_size,
                seed_namespace=sampling.seed_namespace,
                env_cache=self.env_cache,
                temperature=sampling.temperature,
                show_progress=self.show_progress,
                skip_groups=skip_groups,
                on_episode=on_episode,
                tree_branches=sampling.tree_branches,
            )
        )
        return RunResult(records, stats)


class RayEpisodeRunner(EpisodeRunner):
    """The groups dealt to Ray rollout actors (``rollout/ray_workers.py``), alive for one ``run``."""

    def __init__(self, config: ExperimentConfig, endpoints: Mapping[str, Endpoint], num_workers: int | None = None):
        self.config = config
        self.endpoints = dict(endpoints)
        self.num_workers = num_workers

    def run(
        self,
        tasks: list[dict[str, Any]],
        sampling: Sampling,
        *,
        skip_groups: Collection[int] = (),
        on_group: OnGroup | None = None,
    ) -> RunResult:
        from pettingflow.rollout.ray_workers import RayRolloutWorkers  # imports Ray: only when it is used

        with RayRolloutWorkers(self.config, self.endpoints, self.num_workers) as pool:
            ran = pool.run(
                tasks,
                [i for i in range(len(tasks)) if i not in skip_groups],
                sampling,
                on_group=on_group,
            )
        return RunResult(ran.records, ran.stats, ran.workers)
