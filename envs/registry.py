"""Find env classes by name, build envs from config, and group mixed-env batches.

Names: a class is given either as a short registered name (``code-env``) or as an import path
``package.module:Class``. Built-in names are registered as import paths, so resolving one imports
only the module it needs and does not depend on import side effects.

Caching: every dataset row may name its own env class and env config
(``{"env_class_path", "env_config", "task_data"}``), so one batch can mix envs. ``EnvCache`` keeps one
``EnvFactory`` per (class path, config) -- the config validated and frozen to canonical JSON, so
``{}`` and ``{"max_turns": 4}`` are the same key when 4 is the default. The factory holds what all
episodes of that pair share (e.g. the sandbox) and creates a fresh ``Env`` per episode.
"""

from __future__ import annotations

import importlib
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pettingflow.envs.base import Env, EnvConfig

if TYPE_CHECKING:
    from pettingflow.configs.settings import EnvSettings

T = TypeVar("T")


class RegistryError(LookupError):
    """A name or import path that does not resolve to a usable class."""


class Registry(Generic[T]):
    """Short names -> classes (or lazy ``module:Class`` paths), with one resolution rule.

    ``resolve("code-env")`` looks the name up; ``resolve("pkg.mod:Cls")`` imports it. Anything else
    fails with an error that lists the registered names and shows the import-path form.
    """

    def __init__(self, kind: str, base: type[T]) -> None:
        self.kind = kind
        self.base = base
        self._entries: dict[str, type[T] | str] = {}

    def register(self, name: str, target: type[T] | str | None = None, *, replace: bool = False) -> Any:
        """Register ``target`` under ``name``; without ``target`` this is a class decorator."""

        def _add(obj: type[T] | str) -> type[T] | str:
            if not name or ":" in name:
                raise RegistryError(f"{self.kind} name {name!r} must be non-empty and contain no ':'")
            old = self._entries.get(name)
            if old is not None and not replace and _path_of(old) != _path_of(obj):
                raise RegistryError(
                    f"{self.kind} name {name!r} is already registered to {_path_of(old)}; "
                    "pick another name or pass replace=True"
                )
            self._entries[name] = obj
            return obj

        if target is None:
            return _add
        return _add(target)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def resolve(self, name_or_path: str) -> type[T]:
        """The class for a registered short name or a ``package.module:Class`` path."""
        if not isinstance(name_or_path, str) or not name_or_path.strip():
            raise RegistryError(f"{self.kind} class must be a non-empty string, got {name_or_path!r}")
        key = name_or_path.strip()
        if key in self._entries:
            entry = self._entries[key]
            cls = _import_path(entry, self.kind) if isinstance(entry, str) else entry
        elif ":" in key:
            cls = _import_path(key, self.kind)
        else:
            known = ", ".join(self.names()) or "(none)"
            raise RegistryError(
                f"unknown {self.kind} {key!r}; registered names: {known}; "
                "or give an import path like 'package.module:Class'"
            )
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise RegistryError(
                f"{self.kind} {key!r} resolved to {cls!r}, which is not a subclass of {self.base.__name__}"
            )
        return cls

    def short_name(self, class_path: str) -> str:
        """The first registered name of ``class_path`` (``module:Class``), or the path itself: for row labels."""
        for name, entry in self._entries.items():
            if _path_of(entry) == class_path:
                return name
        return class_path

    def class_path(self, name_or_path: str) -> str:
        """Canonical ``module:QualName`` of what ``name_or_path`` resolves to (a stable cache key)."""
        return _path_of(self.resolve(name_or_path))


def _path_of(obj: type | str) -> str:
    return obj if isinstance(obj, str) else f"{obj.__module__}:{obj.__qualname__}"


def _import_path(path: str, kind: str) -> Any:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise RegistryError(f"{kind} import path {path!r} must look like 'package.module:Class'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name and module_name.startswith(exc.name):
            hint = (
                "; is its package importable here? name the folder that holds it in run.code_paths, or install it "
                "(docs/guides/custom-env.md)"
            )
        raise RegistryError(f"cannot import module {module_name!r} for {kind} {path!r}: {exc}{hint}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise RegistryError(f"module {module_name!r} has no attribute {attr!r} (from {kind} {path!r})") from exc
    return obj


ENV_REGISTRY: Registry[Env] = Registry("env", Env)
ENV_REGISTRY.register("code-env", "pettingflow.envs.code_env:CodeEnv")
ENV_REGISTRY.register("plan-path", "pettingflow.envs.plan_path:PlanPathEnv")
ENV_REGISTRY.register("sudoku", "pettingflow.envs.sudoku:SudokuEnv")
ENV_REGISTRY.register("math-tool", "pettingflow.envs.math_tool:MathToolEnv")


def register_env(name: str, target: type[Env] | str | None = None, *, replace: bool = False) -> Any:
    """Register an env class (or a lazy ``module:Class`` path) under a short name; usable as decorator."""
    return ENV_REGISTRY.register(name, target, replace=replace)


def resolve_env_class(name_or_path: str) -> type[Env]:
    """The ``Env`` subclass for a short name or ``package.module:Class``."""
    return ENV_REGISTRY.resolve(name_or_path)


def registered_envs() -> list[str]:
    return ENV_REGISTRY.names()


# --------------------------------------------------------------------------------------------------
# specs: which env (class + config) a task runs in
# --------------------------------------------------------------------------------------------------
def freeze_config(config: EnvConfig | Mapping[str, Any] | None) -> str:
    """Canonical JSON of a config (sorted keys): hashable, equal for equal configs."""
    data = config.model_dump(mode="json") if isinstance(config, EnvConfig) else dict(config or {})
    try:
        return json.dumps(data, sort_keys=True, separators=(",", ":"))
    except TypeError as exc:
        raise ValueError(f"env config must be JSON-serializable to be used as a cache key: {exc}") from exc


@dataclass(frozen=True)
class EnvSpec:
    """An env class and its validated config; hashable, so it is the cache and grouping key.

    Build with ``EnvSpec.of(...)``: it resolves short names to the canonical ``module:Class`` path
    and validates the config with the class's ``Config`` model (defaults filled in).
    """

    class_path: str
    config_json: str = "{}"

    @classmethod
    def of(cls, class_path: str, config: EnvConfig | Mapping[str, Any] | None = None) -> EnvSpec:
        env_cls = resolve_env_class(class_path)
        return cls(_path_of(env_cls), freeze_config(env_cls.validate_config(config)))

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(self.config_json)

    def env_class(self) -> type[Env]:
        return resolve_env_class(self.class_path)


def env_spec_from_settings(settings: EnvSettings) -> EnvSpec:
    """The default env of an experiment: ``env.class_path`` with ``max_turns``, ``sandbox`` and ``options``.

    Only the keys the env itself uses are passed; dataset and batching settings belong to the
    engine. Env classes whose ``Config`` has no ``sandbox`` key get only ``max_turns``.
    """
    env_cls = resolve_env_class(settings.class_path)
    config: dict[str, Any] = {"max_turns": settings.max_turns}
    if "sandbox" in env_cls.Config.model_fields:
        config["sandbox"] = settings.sandbox.model_dump(mode="json")
    clash = sorted(set(settings.options) & set(config))
    if clash:
        raise ValueError(f"env.options must not repeat {clash}: set them as env.{clash[0]} instead")
    config.update(settings.options)
    return EnvSpec.of(settings.class_path, config)


@dataclass(frozen=True)
class TaskSpec:
    """One dataset row: the env it runs in, its task data and its position in the batch."""

    env: EnvSpec
    task: Mapping[str, Any]
    index: int

    @classmethod
    def from_row(cls, row: Mapping[str, Any], default_env: EnvSpec, index: int) -> TaskSpec:
        """A row is either ``{"env_class_path"?, "env_config"?, "task_data"}`` or a bare task.

        Missing ``env_class_path`` means the default env's class; missing ``env_config`` means the
        default env's config when the class is the default one, else that class's defaults.
        """
        keys = {"env_class_path", "env_config", "task_data"}
        if not keys & set(row):
            return cls(default_env, dict(row), index)
        if "task_data" not in row:
            raise ValueError(f"row {index} names an env ({sorted(keys & set(row))}) but has no 'task_data'")
        class_path = row.get("env_class_path") or default_env.class_path
        config = row.get("env_config")
        if config is None and resolve_env_class(class_path) is default_env.env_class():
            env = default_env
        else:
            env = EnvSpec.of(class_path, config)
        return cls(env, dict(row["task_data"]), index)


def task_specs_from_rows(rows: Sequence[Mapping[str, Any]], default_env: EnvSpec) -> list[TaskSpec]:
    return [TaskSpec.from_row(row, default_env, i) for i, row in enumerate(rows)]


# --------------------------------------------------------------------------------------------------
# factories and the cache
# --------------------------------------------------------------------------------------------------
class EnvFactory:
    """Creates episodes of one (env class, config); builds the shared resources once, lazily."""

    def __init__(self, spec: EnvSpec, *, shared: Mapping[str, Any] | None = None) -> None:
        self.spec = spec
        self.env_cls = spec.env_class()
        self.config = self.env_cls.validate_config(spec.config)
        self._shared: dict[str, Any] | None = dict(shared) if shared is not None else None
        self._lock = threading.Lock()

    @property
    def shared(self) -> dict[str, Any]:
        with self._lock:
            if self._shared is None:
                self._shared = dict(self.env_cls.shared_resources(self.config))
            return self._shared

    def create(
        self, task: Mapping[str, Any], *, env_idx: int = 0, rollout_idx: int = 0, seed: int | None = None
    ) -> Env:
        """A fresh env for one episode of ``task`` (already ``reset(seed)``)."""
        return self.env_cls(task, self.config, env_idx=env_idx, rollout_idx=rollout_idx, seed=seed, **self.shared)


class EnvCache:
    """One ``EnvFactory`` per ``EnvSpec`` (the env cache). Thread-safe."""

    def __init__(self, make_factory: Callable[[EnvSpec], EnvFactory] = EnvFactory) -> None:
        self._make_factory = make_factory
        self._factories: dict[EnvSpec, EnvFactory] = {}
        self._lock = threading.Lock()

    def get(self, spec: EnvSpec) -> EnvFactory:
        with self._lock:
            factory = self._factories.get(spec)
            if factory is None:
                factory = self._factories[spec] = self._make_factory(spec)
            return factory

    def __len__(self) -> int:
        return len(self._factories)

    def __contains__(self, spec: object) -> bool:
        return spec in self._factories

    def clear(self) -> None:
        with self._lock:
            self._factories.clear()
