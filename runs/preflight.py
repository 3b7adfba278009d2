"""Check an experiment before anything starts: every class path resolves, the tasks load, the models exist.

Why: a wrong ``class_path``, a task file with a bad row or an unprepared model otherwise fails minutes into a
run, after a Prefect server, Ray and a vLLM server have started. ``pettingflow check`` runs this in about a
second. It imports the env and agent classes (so a user's own package must be importable here, as on the
worker), validates each env's config, reads the task file, builds every task's env spec (a row may name its
own env) and asks that env whether it can run the task (``Env.validate_task``), checks that the env's
``solved``/``failed`` hooks can be called as ``finish_turn`` calls them (``outcome_hook_problems``), and that
each agent's ``envs`` names resolvable envs and that every env of the tasks has at least one agent. It builds no env
instance and starts nothing (no sandbox, no server).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from pettingflow.agents.base import resolve_agent_class
from pettingflow.configs.settings import ExperimentConfig
from pettingflow.envs import env_spec_from_settings, load_tasks, task_specs_from_rows
from pettingflow.envs.base import outcome_hook_problems
from pettingflow.envs.registry import ENV_REGISTRY, RegistryError, resolve_env_class
from pettingflow.inference.models import ModelError, resolve_model


class PreflightError(ValueError):
    """What is wrong, naming the config key or the task row, and how to fix it."""


@dataclass
class PreflightReport:
    """What the check resolved, for a person to read (``lines``)."""

    env: str
    agents: dict[str, str]
    models: dict[str, str]
    train_tasks: int
    validation_tasks: int
    envs_in_tasks: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"env: {self.env}"]
        out += [f"agent {name}: {cls}" for name, cls in self.agents.items()]
        out += [f"policy {name}: model {path}" for name, path in self.models.items()]
        mix = ", ".join(f"{env} x{n}" for env, n in self.envs_in_tasks.items())
        out.append(f"tasks: {self.train_tasks} train, {self.validation_tasks} held-out ({mix})")
        out += [f"warning: {w}" for w in self.warnings]
        return out


@contextmanager
def _at(where: str, *errors: type[Exception]) -> Iterator[None]:
    """Turn ``errors`` raised inside into a ``PreflightError`` that names ``where`` (the config key)."""
    try:
        yield
    except errors as exc:
        raise PreflightError(f"{where}: {exc}") from exc


def _path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def preflight(config: ExperimentConfig, *, check_models: bool = True) -> PreflightReport:
    """Resolve what a run of ``config`` needs; raises ``PreflightError`` at the first problem."""
    with _at(f"env (env.class_path={config.env.class_path!r})", RegistryError, ValueError):
        default_env = env_spec_from_settings(config.env)
    agents: dict[str, str] = {}
    agent_envs: dict[str, tuple[type, ...]] = {}
    for i, agent in enumerate(config.agents):
        with _at(f"agents[{i}] ({agent.name!r}).class_path", RegistryError):
            agents[agent.name] = _path(resolve_agent_class(agent.class_path))
        with _at(f"agents[{i}] ({agent.name!r}).envs", RegistryError):
            agent_envs[agent.name] = tuple(resolve_env_class(e) for e in agent.envs)
    models: dict[str, str] = {}
    if check_models:
        for i, policy in enumerate(config.policies):
            with _at(f"policies[{i}] ({policy.name!r}).model", ModelError):
                models[policy.name] = str(resolve_model(policy.model))
    with _at(f"env.dataset ({config.env.dataset.source})", OSError, ValueError):
        split = load_tasks(config.env.dataset, config.env.class_path)
    if not split.train:
        raise PreflightError(
            f"env.dataset ({config.env.dataset.source}) gave no training tasks; add tasks or lower "
            "env.dataset.validation_fraction"
        )
    rows = [*split.train, *split.validation]
    try:
        specs = task_specs_from_rows(rows, default_env)
    except (RegistryError, ValueError) as exc:
        raise PreflightError(f"env.dataset ({config.env.dataset.source}): {exc}") from exc
    envs = Counter(ENV_REGISTRY.short_name(s.env.class_path) for s in specs)
    checked: dict[object, tuple[type, object]] = {}
    for spec in specs:  # each task under the env it runs in (task files check their own rows on load too)
        if spec.env not in checked:
            env_cls = spec.env.env_class()
            if problems := outcome_hook_problems(env_cls):  # how its episodes end (docs/guides/custom-env.md)
                raise PreflightError(f"env {ENV_REGISTRY.short_name(spec.env.class_path)!r}: {'; '.join(problems)}")
            checked[spec.env] = (env_cls, env_cls.validate_config(spec.env.config))
        env_cls, env_config = checked[spec.env]
        try:
            env_cls.validate_task(spec.task, env_config)
        except ValueError as exc:
            where = "train" if spec.index < len(split.train) else "held-out"
            raise PreflightError(
                f"env.dataset ({config.env.dataset.source}): task {spec.index} ({where}) cannot run in "
                f"{ENV_REGISTRY.short_name(spec.env.class_path)!r}: {exc}"
            ) from exc
    for spec in {s.env for s in specs}:
        env_cls = spec.env_class()
        team = [a for a, classes in agent_envs.items() if not classes or any(issubclass(env_cls, c) for c in classes)]
        if not team:
            raise PreflightError(
                f"tasks of env {ENV_REGISTRY.short_name(spec.class_path)!r} have no agent: every agent's "
                f"agents[].envs excludes it; add it to an agent's envs or leave envs empty"
            )
    warnings = []
    if len(split.validation) < config.validation.num_tasks:
        warnings.append(
            f"validation.num_tasks={config.validation.num_tasks} but the held-out split has "
            f"{len(split.validation)} tasks: validation scores those"
        )
    return PreflightReport(
        env=_path(resolve_env_class(config.env.class_path)),
        agents=agents,
        models=models,
        train_tasks=len(split.train),
        validation_tasks=len(split.validation),
        envs_in_tasks=dict(envs),
        warnings=warnings,
    )
