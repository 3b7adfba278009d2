"""The agent base class (PettingLLMs' agent/env interface) and the agent registry.

An agent turns env state into a prompt, a model response into an action, and an action into
results written back into the env. It never holds a reference to another agent: everything one
agent needs from another comes through ``env.state``.

One turn, as the execution engine drives it::

    prompt = agent.update_from_env(turn, env)          # reads env.state -> messages + prompt token ids
    text = <sample from the agent's policy with prompt.token_ids>
    agent.update_from_model(turn, env, text)           # parses text -> agent.current_action
    await agent.step(env)                              # runs the action, writes env.state, sets reward,
                                                       # closes the turn (env.finish_turn)
    if env.done: stop

Sample layouts (``EnvSettings.sample_layout``, as in verl's multi-turn recipe):

* ``per_turn``: every call gets a fresh prompt built from the full current state
  (``system`` + ``user(turn_prompt(env))``); each call is its own training sample.
* ``per_episode``: the agent's conversation is append-only. Its first call is the same as per_turn;
  each later call returns the previous messages + ``assistant(previous response text)`` +
  ``user(observation(env))``. ``AgentPrompt.token_ids`` is always the full templated conversation;
  the engine builds the episode sequence from it (previous sequence + sampled response tokens +
  the new observation tokens, which get mask 0). Because messages are only appended, templates like
  ChatML render each prompt as an extension of the previous one; the engine must still check that
  the previous prompt + response tokens are a prefix of the new ``token_ids`` (a template may render
  the assistant turn differently from what was sampled) and handle a mismatch.

One agent object serves one episode; ``reset()`` clears it for the next.
"""

from __future__ import annotations

import copy
import inspect
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from pettingflow.configs.settings import SamplingSettings
from pettingflow.envs.base import Env, TurnOutcome
from pettingflow.envs.registry import Registry, RegistryError, resolve_env_class

if TYPE_CHECKING:
    from pettingflow.configs.settings import AgentSettings

Layout = Literal["per_turn", "per_episode"]
LAYOUTS: tuple[str, ...] = ("per_turn", "per_episode")


@dataclass(frozen=True)
class AgentPrompt:
    """What the sampler gets: chat messages and their templated token ids (generation prompt included)."""

    messages: list[dict[str, str]]
    token_ids: list[int]


class ChatTokenizer(Protocol):
    """The part of a Hugging Face tokenizer that agents use."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def chat_token_ids(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Prompt token ids of ``messages`` with the generation prompt appended.

    transformers 5 may return a plain list, a batched ``[[...]]`` list, or a ``BatchEncoding``/dict
    holding ``input_ids`` (possibly a tensor); all become one flat ``list[int]``.
    """
    out = tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True, tokenize=True)
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"] if isinstance(out, Mapping) else out.input_ids
    if hasattr(out, "tolist"):
        out = out.tolist()
    if isinstance(out, (list, tuple)) and out and isinstance(out[0], (list, tuple)):
        if len(out) != 1:
            raise ValueError(f"apply_chat_template returned a batch of {len(out)} sequences for one conversation")
        out = out[0]
    if not isinstance(out, (list, tuple)) or not all(isinstance(t, int) for t in out):
        raise TypeError(f"apply_chat_template(tokenize=True) returned {type(out).__name__}, expected token ids")
    return list(out)


class Agent(ABC):
    """Base agent. Subclasses implement ``turn_prompt``, ``parse_response`` and ``apply_action``.

    Per-episode data (PettingLLMs' AgentData): ``current_prompt``, ``current_action``,
    ``agent_reward`` (of the last step), ``success`` (of the last step; the engine reads it at episode
    end), ``answer_history`` (raw responses), ``action_history`` (parsed actions), ``reward_history``,
    ``turn_info`` (optional details of the last step that ``apply_action`` sets, e.g. per-turn reward
    parts; the engine copies it into the turn's row, ``info_json["turn"]``).
    """

    default_name: ClassVar[str] = "agent"
    system_prompt: ClassVar[str] = ""
    #: True for the role whose final turn *is* the episode's outcome (the code writer, the plan-path
    #: executor or walker): learning reports score a run by that agent's last-turn success.
    decides_outcome: ClassVar[bool] = False
    #: True for an agent that does not generate (a tool, an environment-side role): the engine takes its reply
    #: from ``scripted_reply`` instead of the model, and its turns are never training rows.
    scripted: ClassVar[bool] = False
    # env classes this agent takes turns in (config ``agents[].envs``); empty: every env. A dataset that mixes
    # envs gives each env its own team: the engine skips agents that do not act in an episode's env.
    env_classes: tuple[type[Env], ...] = ()

    def __init__(
        self,
        name: str | None = None,
        *,
        agent_idx: int = 0,
        policy_name: str = "",
        sampling: SamplingSettings | None = None,
        tokenizer: ChatTokenizer | None = None,
        layout: Layout = "per_turn",
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.name = name or self.default_name
        self.agent_idx = agent_idx
        self.policy_name = policy_name
        self.sampling = sampling or SamplingSettings()
        self.tokenizer = tokenizer
        self.layout: Layout = layout
        self.reset()

    def reset(self) -> None:
        """Forget the episode: prompts, actions, rewards and the conversation."""
        self.current_prompt: AgentPrompt | None = None
        self.current_action: Any = None
        self.agent_reward: float | None = None
        self.success = False
        self.answer_history: list[str] = []
        self.action_history: list[Any] = []
        self.reward_history: list[float] = []
        self.turn_info: dict[str, Any] = {}
        self._conversation: list[dict[str, str]] = []
        self._prefix = ""  # this turn's answer_prefix
        self._awaiting: Literal["prompt", "response", "step"] = "prompt"

    # ----------------------------------------------------------------------------------------------
    # what subclasses provide
    # ----------------------------------------------------------------------------------------------
    @abstractmethod
    def turn_prompt(self, env: Env) -> str:
        """The user message built from the full current state (per_turn, and the first per_episode call)."""

    def scripted_reply(self, turn: int, env: Env) -> str:
        """A scripted agent's reply (``scripted = True``), in place of a model's; then parsed and stepped as usual."""
        raise NotImplementedError(f"agent {self.name!r} is scripted but does not implement scripted_reply()")

    def answer_prefix(self, env: Env) -> str:
        """Text the reply starts with, written into the prompt after the assistant header (a prefill): the model
        continues it, and ``parse_response`` sees prefix + reply. Default: none.

        Why: a small model asked for "Moves: R D" often answers with prose; starting its reply with "Moves:" puts
        it where a move list comes next. The prefix is prompt (mask 0), never trained as the model's tokens.
        Only the per_turn layout (a per_episode sequence would have to carry it between turns).
        """
        return ""

    @property
    def prefill(self) -> str:
        """This turn's ``answer_prefix`` (set by ``update_from_env``): the reply's first characters, written by the
        prompt, not by the model. The engine stores it with the turn (the ``prefill`` column), so a printout or
        the viewer shows the reply as the parser saw it: prefill + model text."""
        return self._prefix

    def observation(self, env: Env) -> str:
        """The user message appended in per_episode mode after this agent's previous response:
        what changed since then. Defaults to the full ``turn_prompt``."""
        return self.turn_prompt(env)

    @abstractmethod
    def parse_response(self, response_text: str, env: Env) -> Any:
        """The action in ``response_text``; must not raise on malformed text (bad text = bad action).

        ``response_text`` is the whole reply as the parser should read it: this turn's ``answer_prefix`` (the
        prefill) followed by the model's text. The stored turn keeps the two apart (``prefill`` and
        ``response_text`` columns), because only the model's tokens are trained."""

    @abstractmethod
    async def apply_action(self, env: Env) -> tuple[float, bool]:
        """Carry out ``current_action``: write results into ``env.state``; return (reward, success)."""

    # ----------------------------------------------------------------------------------------------
    # the turn cycle
    # ----------------------------------------------------------------------------------------------
    def update_from_env(self, turn: int, env: Env) -> AgentPrompt:
        """Read the env and return (and keep as ``current_prompt``) the prompt for this turn."""
        self._check_turn(turn, env)
        if self._awaiting == "response":
            raise RuntimeError(f"agent {self.name!r}: update_from_model was not called for the previous prompt")
        if self.tokenizer is None:
            raise RuntimeError(f"agent {self.name!r} has no tokenizer; pass tokenizer= when building it")
        if self.layout == "per_episode" and self._conversation:
            messages = [
                *self._conversation,
                {"role": "assistant", "content": self.answer_history[-1]},
                {"role": "user", "content": self.observation(env)},
            ]
        else:
            messages = [{"role": "user", "content": self.turn_prompt(env)}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
        self._conversation = [dict(m) for m in messages]
        token_ids = chat_token_ids(self.tokenizer, messages)
        self._prefix = self.answer_prefix(env)
        if self._prefix:
            if self.layout != "per_turn":
                raise ValueError(
                    f"agent {self.name!r} starts its replies with {self._prefix!r}, which needs "
                    "env.sample_layout=per_turn (a per_episode sequence cannot carry the prefix between turns)"
                )
            token_ids = token_ids + list(self.tokenizer.encode(self._prefix, add_special_tokens=False))
        self.current_prompt = AgentPrompt(messages=messages, token_ids=token_ids)
        self._awaiting = "response"
        return self.current_prompt

    def update_from_model(self, turn: int, env: Env, response_text: str) -> Any:
        """Parse the model's reply into ``current_action`` (also returned)."""
        self._check_turn(turn, env)
        if self._awaiting != "response":
            raise RuntimeError(f"agent {self.name!r}: update_from_env must come before update_from_model")
        action = self.parse_response(self._prefix + response_text, env)
        self.answer_history.append(response_text)
        self.action_history.append(action)
        self.current_action = action
        self._awaiting = "step"
        return action

    async def step(self, env: Env) -> None:
        """Execute ``current_action`` in ``env``, record reward/success, close the env turn."""
        if self._awaiting != "step":
            raise RuntimeError(f"agent {self.name!r}: step() needs an action from update_from_model first")
        if env.done:
            raise RuntimeError(f"agent {self.name!r}: the episode is already over ({env!r})")
        self.turn_info = {}
        reward, success = await self.apply_action(env)
        self.agent_reward = float(reward)
        self.success = bool(success)
        self.reward_history.append(self.agent_reward)
        self._awaiting = "prompt"
        env.finish_turn(
            {"agent_name": self.name, "agent_idx": self.agent_idx, "reward": self.agent_reward, "success": self.success}
        )

    def fork(self) -> Agent:
        """A copy for one candidate of a tree rollout (``rollout.mode: tree``): the engine gives each of the K
        candidates its own (agent, env) fork, so parsing and stepping one candidate never shows in another.

        Lists and dicts (histories, conversation, ``turn_info``) are copied one level deep; the tokenizer, the
        sampling settings and everything else are shared. A subclass that keeps other mutable per-episode
        state must copy it too.
        """
        twin = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, (list, dict)):
                setattr(twin, name, copy.copy(value))
        return twin

    def acts_in(self, env: Env) -> bool:
        """Whether this agent takes turns in ``env`` (always, unless ``env_classes`` lists classes)."""
        return not self.env_classes or isinstance(env, self.env_classes)

    def _check_turn(self, turn: int, env: Env) -> None:
        if turn != env.current_turn:
            raise ValueError(f"agent {self.name!r} was called for turn {turn}, but the env is at {env.current_turn}")
        if env.done:
            raise RuntimeError(f"agent {self.name!r}: the episode is already over ({env!r})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, agent_idx={self.agent_idx}, policy={self.policy_name!r})"


class EnvActionAgent(Agent):
    """An agent whose action is one call of an env method that returns a ``TurnOutcome`` (plan-path, sudoku,
    math-tool): subclasses say which call in ``submit``; its reward and success are the turn's, its ``info``
    the row's ``turn_info``."""

    @abstractmethod
    def submit(self, env: Env) -> TurnOutcome | Awaitable[TurnOutcome]:
        """Hand ``current_action`` to the env (a coroutine for envs that run code, e.g. in the sandbox)."""

    async def apply_action(self, env: Env) -> tuple[float, bool]:
        outcome = self.submit(env)
        if inspect.isawaitable(outcome):
            outcome = await outcome
        self.turn_info = outcome.info
        return outcome.reward, outcome.success


# --------------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------------
AGENT_REGISTRY: Registry[Agent] = Registry("agent", Agent)
AGENT_REGISTRY.register("code-generator", "pettingflow.agents.code_agents:CodeGeneratorAgent")
AGENT_REGISTRY.register("unit-test-generator", "pettingflow.agents.code_agents:UnitTestGeneratorAgent")
AGENT_REGISTRY.register("plan-path-planner", "pettingflow.agents.plan_agents:PlannerAgent")
AGENT_REGISTRY.register("plan-path-executor", "pettingflow.agents.plan_agents:ExecutorAgent")
AGENT_REGISTRY.register("plan-path-walker", "pettingflow.agents.plan_agents:WalkerAgent")
AGENT_REGISTRY.register("sudoku-proposer", "pettingflow.agents.sudoku_agents:ProposerAgent")
AGENT_REGISTRY.register("sudoku-filler", "pettingflow.agents.sudoku_agents:FillerAgent")
AGENT_REGISTRY.register("math-tool-tool", "pettingflow.agents.math_agents:ToolAgent")
AGENT_REGISTRY.register("math-tool-reasoner", "pettingflow.agents.math_agents:ReasonerAgent")


def register_agent(name: str, target: type[Agent] | str | None = None, *, replace: bool = False) -> Any:
    """Register an agent class (or a lazy ``module:Class`` path) under a short name; usable as decorator."""
    return AGENT_REGISTRY.register(name, target, replace=replace)


def resolve_agent_class(name_or_path: str) -> type[Agent]:
    """The ``Agent`` subclass for a short name or ``package.module:Class``."""
    return AGENT_REGISTRY.resolve(name_or_path)


def registered_agents() -> list[str]:
    return AGENT_REGISTRY.names()


def build_agent(
    settings: AgentSettings, *, agent_idx: int, tokenizer: ChatTokenizer | None, layout: Layout = "per_turn"
) -> Agent:
    """An agent from its config entry; ``agent_idx`` is its position in the turn order."""
    cls = resolve_agent_class(settings.class_path)
    agent = cls(
        settings.name,
        agent_idx=agent_idx,
        policy_name=settings.policy,
        sampling=settings.sampling,
        tokenizer=tokenizer,
        layout=layout,
    )
    if settings.envs:
        try:
            agent.env_classes = tuple(resolve_env_class(e) for e in settings.envs)
        except RegistryError as exc:
            raise RegistryError(f"agents[{agent_idx}] ({settings.name!r}).envs: {exc}") from exc
    return agent
