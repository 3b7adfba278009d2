"""Test doubles for the execution engine: a scripted LLM, a char-level ChatML tokenizer, a toy env.

The tokenizer maps each character to its code point, so token ids can be checked by eye and the
per-episode env-token arithmetic is exact.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pettingflow.configs.settings import SamplingSettings

EOS = "\x03"  # one character = one token


class CharChatTokenizer:
    """ChatML-shaped template over single characters; eos is one character."""

    eos_token = EOS
    eos_token_id = ord(EOS)

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}{EOS}\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text) if tokenize else text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


@dataclass(frozen=True)
class FakeCompletion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str


class ScriptedLLM:
    """Answers from a function of (model, prompt text, call params); records every call."""

    def __init__(self, tokenizer: CharChatTokenizer, reply=None, end_with_eos: bool = True):
        self.tok = tokenizer
        self.reply = reply or (lambda model, prompt, params: f"{model}-answer")
        self.end_with_eos = end_with_eos
        self.calls: list[dict[str, Any]] = []

    async def complete_one(self, prompt_ids: list[int], *, model: str, **params: Any) -> FakeCompletion:
        self.calls.append(
            {"model": model, "prompt": self.tok.decode(prompt_ids), "prompt_ids": list(prompt_ids), **params}
        )
        return await self._answer(prompt_ids, model, params)

    async def complete(self, prompt_ids: list[int], *, model: str, n: int = 1, **params: Any) -> list[FakeCompletion]:
        """``n`` choices in one call (recorded once, with ``n``); choice k sees seed + k, as vLLM samples it."""
        self.calls.append(
            {"model": model, "prompt": self.tok.decode(prompt_ids), "prompt_ids": list(prompt_ids), "n": n, **params}
        )
        out = []
        for k in range(n):
            seed = None if params.get("seed") is None else params["seed"] + k
            out.append(await self._answer(prompt_ids, model, dict(params, seed=seed)))
        return out

    async def _answer(self, prompt_ids: list[int], model: str, params: dict[str, Any]) -> FakeCompletion:
        await asyncio.sleep(0)
        text = self.reply(model, self.tok.decode(prompt_ids), params)[: params["max_tokens"]]
        ids = self.tok.encode(text)
        finish = "length"
        if self.end_with_eos and len(ids) < params["max_tokens"]:
            ids = [*ids, self.tok.eos_token_id]
            finish = "stop"
        return FakeCompletion(ids, [-0.1 * (i + 1) for i in range(len(ids))], finish, text)


@dataclass(frozen=True)
class Prompt:
    messages: list[dict[str, str]]
    token_ids: list[int]


@dataclass
class ToyState:
    board: list[str] = field(default_factory=list)


class ToyEnv:
    """Agents append their answers to a shared board; done when an answer contains 'DONE'."""

    def __init__(self, task: Any, max_turns: int = 4):
        self.task, self.max_turns = task, max_turns
        self.current_turn, self.done, self.state, self.history = 0, False, ToyState(), []
        self.reset_seeds: list[int] = []

    def reset(self, seed: int) -> None:
        self.reset_seeds.append(seed)
        self.state, self.done, self.current_turn, self.history = ToyState(), False, 0, []


class ToyAgent:
    """Reads the board from env.state (its only input) and writes its answer back."""

    def __init__(self, name: str, tokenizer: CharChatTokenizer, layout: str, max_tokens: int = 64):
        self.name, self.tok, self.layout = name, tokenizer, layout
        self.sampling = SamplingSettings(temperature=0.7, max_tokens=max_tokens)
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict[str, str]] = []
        self.action: str | None = None
        self.agent_reward, self.success = 0.0, False
        self.seen_boards: list[list[str]] = []

    def update_from_env(self, turn: int, env: ToyEnv) -> Prompt:
        self.seen_boards.append(list(env.state.board))
        observation = f"{env.task}|{'/'.join(env.state.board)}"
        if self.layout == "per_episode" and self.messages:
            self.messages = [
                *self.messages,
                {"role": "assistant", "content": self.action or ""},
                {"role": "user", "content": observation},
            ]
        else:
            self.messages = [{"role": "user", "content": observation}]
        return Prompt(list(self.messages), self.tok.apply_chat_template(self.messages, add_generation_prompt=True))

    def update_from_model(self, turn: int, env: ToyEnv, response: str) -> str:
        self.action = response
        return response

    async def step(self, env: ToyEnv) -> None:
        env.state.board.append(f"{self.name}:{self.action}")
        self.agent_reward = float(len(env.state.board))
        self.success = "DONE" in (self.action or "")
        if self.success:
            env.done = True


from pettingflow.envs.base import Env, EnvConfig  # noqa: E402


class BoardConfig(EnvConfig):
    label: str = "a"


class BoardEnv(Env):
    """A registered-style Env (importable as ``rollout_fakes:BoardEnv``) with the ToyEnv board."""

    Config = BoardConfig

    def initial_state(self) -> ToyState:
        return ToyState()


def plan_path_engine_rows(
    reply: Any,
    *,
    tokenizer: Any,
    tasks: list[dict[str, Any]],
    layout: str = "per_turn",
    group_size: int = 2,
    max_turns: int = 6,
    token_budget: int | None = None,
    tree_branches: int | None = None,
    tree_select: str = "best",
    overrides: tuple[str, ...] = (),
) -> tuple[list[Any], Any, list[dict[str, Any]], ScriptedLLM]:
    """Plan-path episodes through the real ``ExecutionEngine`` with a scripted LLM: (records, stats, rows, llm).

    ``tree_branches`` set: AT-GRPO tree mode (one episode per task, K candidates per turn: groups of K rows);
    otherwise ``group_size`` independent samples per task."""
    from pettingflow.agents import build_agent
    from pettingflow.configs import load_config
    from pettingflow.envs import EnvCache
    from pettingflow.rollout.engine import AgentBinding, ExecutionEngine
    from pettingflow.rollout.local import episode_specs
    from pettingflow.rollout.records import build_rows

    config = load_config("plan-path", [f"env.max_turns={max_turns}", f"env.sample_layout={layout}", *overrides])
    tree = tree_branches is not None
    specs = episode_specs(
        config, tasks, group_size=1 if tree else group_size, seed_namespace="t/", env_cache=EnvCache()
    )
    llm = ScriptedLLM(tokenizer, reply=reply)
    bindings = {
        a.name: AgentBinding(client=llm, served_model=a.name, tokenizer=tokenizer, policy_name="shared")
        for a in config.agents
    }
    extra = {"tree_branches": tree_branches, "tree_select": tree_select} if tree else {}
    engine = ExecutionEngine(
        lambda: [build_agent(a, agent_idx=i, tokenizer=tokenizer, layout=layout) for i, a in enumerate(config.agents)],
        bindings,
        max_turns=max_turns,
        token_budget=config.env.token_budget if token_budget is None else token_budget,
        layout=layout,
        show_progress=False,
        **extra,
    )
    records, stats = asyncio.run(engine.run(specs))
    rows = build_rows(records, layout, "run", 0, group_size=1 if tree else group_size)
    return records, stats, rows, llm
