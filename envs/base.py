"""The environment base class: one episode's shared state (PettingLLMs' agent/env interface).

An ``Env`` is the single place where agents leave information for each other: an agent reads
``env.state`` to build its prompt and writes the results of its action back into ``env.state``.
Agents never talk to each other directly, so agents can be added, removed or reordered by config.

The env does not decide who acts next: the execution engine takes the turn order from the config's
``agents`` list. The env only counts turns (one turn = one agent call, over all agents), records a
history and decides when the episode is over and how it ended (``outcome``): ``solved()``, ``failed()`` (the
episode is lost, e.g. a rule was broken) or ``max_turns`` reached. The engine adds ``not_finished`` for an episode
it stopped itself (token budget or model context exhausted).

One ``Env`` object holds one episode. Expensive things that every episode of the same
(class, config) can share -- a sandbox, a tokenizer -- are built once by ``shared_resources`` and
handed to each new env by ``pettingflow.envs.registry.EnvFactory``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: How an episode ended (``Env.outcome``, the ``outcome`` column of trajectory rows). ``solved``: ``solved()`` was
#: true after a turn. ``failed``: ``failed()`` was true after a turn (and ``solved()`` was not): the env ended the
#: episode as lost. ``max_turns``: the turn limit came first. ``not_finished``: the episode stopped before the env
#: ended it (the token budget or the model's context ran out); only the engine sets it.
SOLVED: Final = "solved"
FAILED: Final = "failed"
MAX_TURNS: Final = "max_turns"
NOT_FINISHED: Final = "not_finished"
OUTCOMES: Final = (SOLVED, FAILED, MAX_TURNS, NOT_FINISHED)


class EnvConfig(BaseModel):
    """Settings every env understands. Subclasses extend it; unknown keys are errors (typos fail fast)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_turns: int = Field(4, ge=1, description="Agent calls per episode, counted over all agents.")


@dataclass(frozen=True)
class TurnOutcome:
    """What an env's action method returns for the acting agent's turn: its reward and success, and ``info`` for
    the trajectory row (``info_json["turn"]``). One shape for every env, so agents hand it on the same way
    (``agents.base.EnvActionAgent``) and env services encode it the same way."""

    reward: float
    success: bool
    info: dict[str, Any]


def reported_team_reward(env: Any) -> float | None:
    """``env.episode_info()["team_reward"]`` as a float; None where the env has no ``episode_info`` or no team
    reward in it. The default of ``Env.team_outcome`` and the engine's for envs that are not ``Env`` subclasses."""
    episode_info = getattr(env, "episode_info", None)
    if not callable(episode_info):
        return None
    value = episode_info().get("team_reward")
    return None if value is None else float(value)


def terminal_outcome(env: Any) -> str | None:
    """How ``env``'s episode ended (one of ``OUTCOMES`` but ``not_finished``), or None while it runs.

    ``Env`` subclasses set ``env.outcome`` in ``finish_turn``; for other objects that quack like an env (test
    doubles, envs of older code) it is derived from ``done``/``truncated`` and their ``solved``/``failed``, if any:
    ended on a limit is ``max_turns``, else ``solved`` where ``solved()`` says so (or there is no ``solved``, as
    ``done`` alone used to mean), else ``failed``.
    """
    outcome = getattr(env, "outcome", None)
    if outcome in OUTCOMES:
        return outcome
    if not getattr(env, "done", False):
        return None
    if getattr(env, "truncated", False):
        return MAX_TURNS
    solved = getattr(env, "solved", None)
    return SOLVED if not callable(solved) or solved() else FAILED


def outcome_hook_problems(env_cls: type) -> list[str]:
    """What is wrong with how ``env_cls`` decides its episodes' outcome, found without building one (for
    ``pettingflow check``): ``solved``/``failed`` that are not methods taking only ``self``, and ``done``,
    ``truncated`` or ``outcome`` overridden as class attributes or properties (``finish_turn`` sets them)."""
    import inspect

    problems = []
    for name in ("solved", "failed"):
        hook = inspect.getattr_static(env_cls, name, None)
        if hook is None:
            continue
        if not inspect.isfunction(hook):
            problems.append(
                f"{env_cls.__qualname__}.{name} must be a plain method `def {name}(self) -> bool`, got "
                f"{type(hook).__name__}"
            )
            continue
        required = [
            p
            for p in list(inspect.signature(hook).parameters.values())[1:]
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if required:
            problems.append(
                f"{env_cls.__qualname__}.{name} takes {[p.name for p in required]}, but Env.finish_turn calls "
                f"{name}() with no arguments; read what it needs from self.state"
            )
    for name in ("done", "truncated", "outcome"):
        if any(name in vars(klass) for klass in env_cls.__mro__ if klass is not object):
            problems.append(
                f"{env_cls.__qualname__} defines {name!r} on the class; Env.finish_turn sets it per episode from "
                "solved(), failed() and max_turns: remove it and end an episode through solved() or failed()"
            )
    return problems


class EnvConfigError(ValueError):
    """An env config that does not validate against the env class's ``Config`` model."""


class TaskDataError(ValueError):
    """A task that an env class cannot run; ``field`` names the task key at fault (for file-loading errors)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class Env:
    """One episode: task, shared state, turn counter, history.

    Attributes (as in PettingLLMs): ``env_idx`` (position in the batch), ``rollout_idx`` (sample within the
    GRPO group), ``max_turns``, ``current_turn``, ``state`` (env-specific shared state), ``done`` (the episode is
    over: solved, failed or out of turns), ``truncated`` (ended by ``max_turns``, neither solved nor failed),
    ``outcome`` (how it ended: ``solved``, ``failed``, ``max_turns``; None while it runs), ``task`` (the task dict),
    ``history`` (one record per finished turn), ``config`` (the validated ``Config`` model) and
    ``seed`` (of the last ``reset``).

    Subclasses implement ``initial_state``, usually ``solved``, and ``failed`` where an episode can be lost
    before its last turn.
    """

    Config: ClassVar[type[EnvConfig]] = EnvConfig

    def __init__(
        self,
        task: Mapping[str, Any],
        config: EnvConfig | Mapping[str, Any] | None = None,
        *,
        env_idx: int = 0,
        rollout_idx: int = 0,
        seed: int | None = None,
    ) -> None:
        self.config = self.validate_config(config)
        self.task: dict[str, Any] = dict(task)
        self.env_idx = env_idx
        self.rollout_idx = rollout_idx
        self.max_turns = self.config.max_turns
        self.current_turn = 0
        self.state: Any = None
        self.done = False
        self.truncated = False
        self.outcome: str | None = None
        self.history: list[dict[str, Any]] = []
        self.seed: int | None = None
        self.reset(seed)

    # ----------------------------------------------------------------------------------------------
    # hooks for subclasses
    # ----------------------------------------------------------------------------------------------
    def initial_state(self) -> Any:
        """The state at turn 0 for ``self.task`` (and ``self.seed``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement initial_state()")

    def solved(self) -> bool:
        """Whether the task is solved; a solved episode ends before ``max_turns``."""
        return False

    def failed(self) -> bool:
        """Whether the episode is lost: it ends now, in failure, before ``max_turns`` (``outcome`` ``failed``).

        Why: an env whose rules can end an episode early (a word game whose clue gave the word away, a move that
        breaks the board) must not report that as solved, and must not run on to ``max_turns`` either; success
        rates count such an episode as a failure even when the agent that decides the outcome never acted.
        Checked after each turn, after ``solved()`` (solved wins); the default never fails. Usually the action
        method that sees the broken rule records it in ``state`` and this returns it.
        """
        return False

    def team_outcome(self) -> float | None:
        """The team reward the episode would get if it ended now; None: this env has no team reward.

        Why: tree rollouts with ``rollout.tree.team_credit`` other than ``shared`` credit each candidate with the
        team outcome reached on its own fork (right after its action, or after a lookahead), so siblings whose
        actions move the team differently differ. The default reads ``episode_info()["team_reward"]`` where the env
        defines ``episode_info``; an env whose team reward is cheaper or richer mid-episode overrides this.
        """
        return reported_team_reward(self)

    @classmethod
    def validate_task(cls, task: Mapping[str, Any], config: EnvConfig) -> None:
        """Raise ``TaskDataError`` if ``task`` cannot start an episode under ``config``; the base accepts any.

        Why: task files are checked when they are loaded (``envs/task_files.py``), so a bad row fails with its
        file, row and field before any server starts, not mid-rollout. It must be cheap: no sandbox, no model.
        """

    @classmethod
    def shared_resources(cls, config: EnvConfig) -> dict[str, Any]:
        """Keyword arguments shared by every env of this (class, config), built once per cache entry.

        Why: building a sandbox (or loading a tokenizer) per episode would dominate rollout time.
        The returned mapping is passed to ``__init__`` of each env the factory creates.
        """
        return {}

    # ----------------------------------------------------------------------------------------------
    # lifecycle
    # ----------------------------------------------------------------------------------------------
    @classmethod
    def validate_config(cls, config: EnvConfig | Mapping[str, Any] | None) -> EnvConfig:
        """``config`` as this class's ``Config`` model; a clear error names the bad keys."""
        if isinstance(config, cls.Config):
            return config
        data = config.model_dump() if isinstance(config, BaseModel) else dict(config or {})
        try:
            return cls.Config.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
            )
            known = ", ".join(cls.Config.model_fields)
            raise EnvConfigError(f"invalid config for {cls.__name__}: {problems} (known keys: {known})") from exc

    def reset(self, seed: int | None = None) -> None:
        """Start the episode again from turn 0 with the same task.

        The same seed gives the same initial state, which GRPO group sampling relies on (verl's multi-turn recipe).
        """
        self.seed = seed
        self.current_turn = 0
        self.done = False
        self.truncated = False
        self.outcome = None
        self.history = []
        self.state = self.initial_state()

    def finish_turn(self, record: Mapping[str, Any] | None = None) -> None:
        """Close the current turn: record it, advance the counter, decide ``done``/``truncated``/``outcome``.

        Called once per agent call (by ``Agent.step``), after the agent wrote its results into
        ``state``. ``solved()`` ends the episode as ``solved``; else ``failed()`` as ``failed``; else reaching
        ``max_turns`` as ``max_turns`` (``truncated``).
        """
        if self.done:
            raise RuntimeError(
                f"env {self.env_idx}/{self.rollout_idx} is already done at turn {self.current_turn}; "
                "call reset() before taking more turns"
            )
        self.history.append({"turn": self.current_turn, **(record or {})})
        self.current_turn += 1
        solved = bool(self.solved())
        failed = not solved and bool(self.failed())
        out_of_turns = self.current_turn >= self.max_turns
        self.done = solved or failed or out_of_turns
        self.truncated = out_of_turns and not solved and not failed
        self.outcome = SOLVED if solved else FAILED if failed else MAX_TURNS if out_of_turns else None

    def fork(self) -> Env:
        """An independent copy of this episode, for tree rollouts (``rollout.mode: tree``).

        The engine scores each of the K candidates of a turn on its own fork (``agent.step(fork)``), so
        the real episode is never touched by a candidate; the episode then continues on the chosen fork.
        A fork must copy all per-episode state (``state``, ``history``, counters) and share what is shared
        (sandbox, caches). Envs opt in by overriding this, usually as ``return self._copy_episode()``;
        the base refuses, so an env whose state cannot be copied fails clearly instead of leaking
        candidates into each other.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot fork an episode, which rollout.mode=tree needs to score each candidate "
            "on its own copy of the state: implement fork() (see Env.fork), or use rollout.mode=independent"
        )

    def _copy_episode(self) -> Env:
        """A shallow copy with ``state``, ``history`` and ``task`` deep-copied: enough for envs whose other
        attributes are shared resources or read-only after ``reset`` (the sandbox, precomputed tables)."""
        twin = copy.copy(self)
        twin.state = copy.deepcopy(self.state)
        twin.history = copy.deepcopy(self.history)
        twin.task = copy.deepcopy(self.task)
        return twin

    def __repr__(self) -> str:
        task_id = self.task.get("task_id", "?")
        return (
            f"{type(self).__name__}(task_id={task_id!r}, env_idx={self.env_idx}, rollout_idx={self.rollout_idx}, "
            f"turn={self.current_turn}/{self.max_turns}, done={self.done}, outcome={self.outcome})"
        )
