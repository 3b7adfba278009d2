"""The multi-agent execution engine: G samples per task, agents taking turns, every call recorded.

One episode (PettingLLMs' agent/env cycle; a per-episode token budget as in verl's multi-turn recipe):

    env.reset(seed)                        # the same seed for all G samples of a group
    for turn in range(max_turns):
        agent = agents[turn % n_agents]    # turn order = config order: code -> test -> code ...
                                           # (only the agents that act in this env: Agent.acts_in)
        prompt = agent.update_from_env(turn, env)
        completion = await llm(prompt)     # exact token ids + sampler log-probs
        agent.update_from_model(turn, env, completion.text)
        await agent.step(env)              # results land in env.state: the only channel between agents
        if env.done or budget spent: stop
    record.info |= env.episode_info()      # optional: per-episode values (e.g. a team reward) for every row

Tree mode (``tree_branches=K``, ``rollout.tree.branches``; AT-GRPO, arXiv 2510.11062; docs/rl.md): one episode
per task (``env.group_size`` 1); at every turn the acting agent's prompt is sampled K times in ONE request
(``n=K``), each candidate is parsed and stepped on its own fork of the (agent, env) pair (``Agent.fork``,
``Env.fork``), so none of them touches the episode, and the episode continues on the fork of the chosen
candidate (``select_branch``). All K candidates are recorded (``TurnRecord.branch_idx``, ``continued``); they
share the prompt, which is what makes them a GRPO group.

An independent episode is the same turn loop with one candidate per turn that acts on the episode itself
(no fork, nothing to choose): ``run_episode`` has one path for both.

Team credit of tree candidates (``team_credit``, ``rollout.tree.team_credit``): the K candidates of a turn share
the episode, so its team reward (``shared``) is the same for all of them and cancels in their group. ``step``
credits each with ``Env.team_outcome()`` on its own fork right after its action; ``round`` and ``episode`` first
let the other agents act on a further fork of it (a lookahead: once each, or until the episode ends; greedy by
default) and credit the team outcome reached there. Lookahead calls are stored with the candidate and count
toward the token budgets; they are never training rows.

The engine never looks inside env state; it only records what each agent saw and produced.
Episodes of all groups run concurrently on one event loop; the inference client bounds concurrent
requests and the sandbox (local or a Ray pool) bounds concurrent code executions.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pettingflow.envs.base import MAX_TURNS, NOT_FINISHED, reported_team_reward, terminal_outcome
from pettingflow.episode_context import episode_scope
from pettingflow.rollout.chat import env_tokens_between
from pettingflow.rollout.records import EpisodeId, EpisodeRecord, TurnRecord, agent_scores, outcome_counts

log = logging.getLogger(__name__)


class Completion(Protocol):
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str


class CompletionClient(Protocol):
    """What the engine needs from inference (``pettingflow.inference.client.InferenceClient``)."""

    async def complete_one(self, prompt_ids: list[int], *, model: str, **sampling: Any) -> Completion: ...

    async def complete(self, prompt_ids: list[int], *, model: str, n: int = 1, **sampling: Any) -> list[Completion]: ...


@dataclass(frozen=True)
class AgentBinding:
    """How one agent is served: its client, the model (or LoRA adapter) name, its tokenizer."""

    client: CompletionClient
    served_model: str
    tokenizer: Any
    policy_name: str
    lora_name: str | None = None


@dataclass(frozen=True)
class EpisodeSpec:
    """One sample of one group: which episode (``id``: env, group, sample, seed), on which task, in which env."""

    id: EpisodeId
    task: Any
    make_env: Callable[[EpisodeSpec], Any]


def group_specs(
    tasks: Sequence[Any],
    group_size: int,
    base_seed: int,
    env_name: str | Callable[[Any], str],
    make_env: Callable[[EpisodeSpec], Any],
    namespace: str = "",
) -> list[EpisodeSpec]:
    """G episode specs per task, all of a group sharing the task and the env seed (verl's multi-turn recipe).

    ``rollout_idx = env_idx * group_size + sample_idx`` so that ``rollout_idx // group_size`` is the
    group, as PettingLLMs' UID rule expects. ``env_name`` may be a function of the task, for
    batches that mix envs.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    specs = []
    for env_idx, task in enumerate(tasks):
        seed = _derive_seed(base_seed, namespace, env_idx)
        group_id = f"g{env_idx}"  # unique within an iteration; rows also carry run_id and iteration
        for sample_idx in range(group_size):
            episode = EpisodeId(
                env_name=env_name(task) if callable(env_name) else env_name,
                env_idx=env_idx,
                group_id=group_id,
                sample_idx=sample_idx,
                rollout_idx=env_idx * group_size + sample_idx,
                seed=seed,
            )
            specs.append(EpisodeSpec(id=episode, task=task, make_env=make_env))
    return specs


def _acts_in(agent: Any, env: Any) -> bool:
    """Agents without ``acts_in`` (plain test doubles) act in every env."""
    acts_in = getattr(agent, "acts_in", None)
    return True if acts_in is None else bool(acts_in(env))


def _derive_seed(*parts: Any) -> int:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


TREE_SELECT = ("best", "sample")
TEAM_CREDIT = ("shared", "step", "round", "episode")


def select_branch(rewards: Sequence[float], how: str, rng: random.Random | None = None) -> int:
    """The candidate a tree episode continues from.

    ``best``: the highest reward; ties go to the lowest index (deterministic, no RNG). ``sample``: index ``k``
    with probability ``softmax(rewards)_k`` (temperature 1), drawn from ``rng`` (seeded by the caller per task
    and turn, so a re-run picks the same branches).
    """
    if not rewards:
        raise ValueError("select_branch needs at least one candidate reward")
    if any(not math.isfinite(r) for r in rewards):
        raise ValueError(f"candidate rewards must be finite, got {list(rewards)}")
    if how == "best":
        return max(range(len(rewards)), key=lambda k: (rewards[k], -k))
    if how == "sample":
        if rng is None:
            raise ValueError("select_branch(how='sample') needs an rng")
        top = max(rewards)
        weights = [math.exp(r - top) for r in rewards]
        return rng.choices(range(len(rewards)), weights=weights)[0]
    raise ValueError(f"unknown tree selection {how!r}; use one of {TREE_SELECT}")


def _fork(obj: Any, what: str) -> Any:
    fork = getattr(obj, "fork", None)
    if not callable(fork):
        raise TypeError(
            f"rollout.mode=tree scores each candidate on a copy of the episode, but {what} {type(obj).__name__} "
            "has no fork(); subclass pettingflow's Env/Agent (or add fork()), or use rollout.mode=independent"
        )
    return fork()


def _team_outcome(env: Any, mode: str) -> float:
    """``env.team_outcome()``, or the ``team_reward`` of ``episode_info()`` for envs without it; an env with
    neither cannot credit candidates by the team's outcome."""
    outcome = getattr(env, "team_outcome", None)
    value = outcome() if callable(outcome) else reported_team_reward(env)
    if value is None:
        raise ValueError(
            f"rollout.tree.team_credit={mode} credits each candidate with the team outcome on its fork, but "
            f"{type(env).__name__} reports none (Env.team_outcome() / episode_info()['team_reward']); give the env a "
            "team reward or use team_credit=shared"
        )
    return float(value)


@dataclass(frozen=True)
class ScriptedReply:
    """A scripted agent's reply in the shape of a completion: text, and no tokens of any model."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    finish_reason: str = "scripted"
    server: str = ""


@dataclass
class TeamCredit:
    """One candidate's team term (None: ``shared``, the episode's team reward applies) and its lookahead calls."""

    value: float | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0


@dataclass
class EngineStats:
    """Per-round totals the iteration report shows."""

    episodes: int = 0
    turns: int = 0
    tokens_generated: int = 0
    lookahead_tokens: int = 0  # of tokens_generated: tree team credit's lookahead calls (never trained)
    wall_s: float = 0.0
    llm_s: float = 0.0
    env_s: float = 0.0
    per_agent: dict[str, dict[str, float]] = field(default_factory=dict)
    # how the episodes ended: {solved, failed, max_turns, not_finished: count}; they add up to ``episodes``
    outcomes: dict[str, float] = field(default_factory=dict)
    # env name -> {"episodes", "tokens_generated", "agents": {agent: scores}}: the same numbers split by env, for
    # a step whose tasks come from several envs (a mixed dataset)
    per_env: dict[str, dict[str, Any]] = field(default_factory=dict)
    # where the wall time went: (start, end) of every LLM call and every env step, in seconds after the
    # start of ``run`` (``timeline()`` summarizes them); not part of any stored output
    llm_spans: list[tuple[float, float]] = field(default_factory=list, repr=False)
    env_spans: list[tuple[float, float]] = field(default_factory=list, repr=False)


class ExecutionEngine:
    """Runs episodes for a fixed team of agents."""

    def __init__(
        self,
        make_agents: Callable[[], list[Any]],
        bindings: dict[str, AgentBinding],
        *,
        max_turns: int,
        token_budget: int,
        layout: str = "per_turn",
        max_model_len: int | None = None,
        sampling_overrides: dict[str, Any] | None = None,
        show_progress: bool = True,
        tree_branches: int | None = None,
        tree_select: str = "best",
        team_credit: str = "shared",
        lookahead_temperature: float = 0.0,
        agent_temperatures: dict[str, float] | None = None,
    ):
        """``tree_branches``: None for independent episodes; K >= 1 for tree episodes (K candidates per turn,
        continued from the one ``tree_select`` picks: ``best`` or ``sample``). ``team_credit``: how each tree
        candidate's row gets its team term (module docstring); ``lookahead_temperature``: the lookahead's sampling
        temperature (0 = greedy). ``agent_temperatures``: agent -> temperature, over ``sampling_overrides`` (an
        evaluation: the agents' own ``eval_temperature``)."""
        if layout not in ("per_turn", "per_episode"):
            raise ValueError(f"unknown sample layout {layout!r}; use per_turn or per_episode")
        if tree_branches is not None and tree_branches < 1:
            raise ValueError(f"tree_branches must be >= 1 (the candidates per turn), got {tree_branches}")
        if tree_select not in TREE_SELECT:
            raise ValueError(f"unknown tree selection {tree_select!r}; use one of {TREE_SELECT}")
        if team_credit not in TEAM_CREDIT:
            raise ValueError(f"unknown team credit {team_credit!r}; use one of {TEAM_CREDIT}")
        if team_credit != "shared" and tree_branches is None:
            raise ValueError(f"team_credit={team_credit!r} credits tree candidates; it needs tree_branches (tree mode)")
        # independent episodes are tree episodes of one candidate per turn that acts on the episode itself
        self.branches = 1 if tree_branches is None else tree_branches
        self.fork = tree_branches is not None
        self.tree_select = tree_select
        self.team_credit = team_credit
        self.lookahead_temperature = lookahead_temperature
        self.make_agents = make_agents
        self.bindings = bindings
        self.max_turns = max_turns
        self.token_budget = token_budget
        self.layout = layout
        self.max_model_len = max_model_len
        self.sampling_overrides = sampling_overrides or {}
        self.agent_temperatures = agent_temperatures or {}
        self.show_progress = show_progress
        self._llm_s = 0.0
        self._env_s = 0.0
        self._t0 = time.perf_counter()
        self._llm_spans: list[tuple[float, float]] = []
        self._env_spans: list[tuple[float, float]] = []

    # ------------------------------------------------------------------ one episode
    async def run_episode(self, spec: EpisodeSpec) -> EpisodeRecord:
        # the episode's requests (all its turns and branches) stay on one inference replica (inference/replicas.py)
        with episode_scope(f"{spec.id.group_id}/{spec.id.sample_idx}"):
            return await self._run_episode(spec)

    async def _run_episode(self, spec: EpisodeSpec) -> EpisodeRecord:
        env = spec.make_env(spec)
        env.reset(spec.id.seed)
        agents = [a for a in self.make_agents() if _acts_in(a, env)]  # a mixed-env dataset: this env's team
        if not agents:
            raise ValueError(
                f"no configured agent acts in {type(env).__name__} (task {spec.id.env_idx}); "
                "add that env to some agent's 'envs' in the config, or leave 'envs' empty"
            )
        for agent in agents:
            agent.reset()
        missing = [a.name for a in agents if a.name not in self.bindings]
        if missing:
            raise KeyError(f"no inference binding for agents {missing}; bound: {sorted(self.bindings)}")
        record = EpisodeRecord(spec.id, tree=self.fork, team_credit=self.team_credit if self.fork else "shared")
        record.team = [a.name for a in agents]
        # per_episode: each agent's growing sequence and the messages behind it
        seq: dict[str, list[int]] = {}
        last_messages: dict[str, list[dict[str, str]]] = {}
        last_turn: dict[str, TurnRecord] = {}

        path_tokens = 0  # tokens of the episode's path: what the budget bounds (tree: the continued candidates)
        out_of_budget = False
        for turn in range(self.max_turns):
            position = turn % len(agents)
            agent = agents[position]
            binding = self.bindings[agent.name]
            prompt = agent.update_from_env(turn, env)
            prompt_ids = list(prompt.token_ids)
            if self.layout == "per_episode" and agent.name in last_turn:
                prompt_ids = self._extend_sequence(agent.name, binding, prompt.messages, seq, last_messages, last_turn)
            max_tokens = self._room(agent, prompt_ids, path_tokens)
            scripted = bool(getattr(agent, "scripted", False))
            if max_tokens <= 0 and not scripted:  # token budget or context exhausted
                out_of_budget = True
                break
            sampling = self._sampling(agent, max_tokens, spec, turn)
            if scripted:  # no model call: one reply, acted on the episode itself (nothing to sample or compare)
                completions = [ScriptedReply(agent.scripted_reply(turn, env))]
                branches = [(agent, env)]
            else:
                completions = await self._generate(binding, prompt_ids, sampling)
                branches = self._candidates(agent, env, len(completions))
            record.tokens_generated += sum(len(c.token_ids) for c in completions)
            for (b_agent, b_env), completion in zip(branches, completions, strict=True):
                b_agent.update_from_model(turn, b_env, completion.text)
            await self._step(branches)
            credits = (
                [TeamCredit()]
                if scripted  # its turn is never a row: nothing to credit
                else await self._team_credits(branches, completions, agents, position, turn, spec, path_tokens)
            )
            lookahead_tokens = sum(c.tokens for c in credits)
            record.tokens_generated += lookahead_tokens
            record.lookahead_tokens += lookahead_tokens
            chosen = self._choose(branches, spec, turn)
            agent, env = branches[chosen]
            agents[position] = agent  # tree: the episode goes on with the chosen candidate's fork
            seed = sampling.get("seed")
            turn_records = [
                TurnRecord(
                    turn_idx=turn,
                    agent_idx=position,
                    agent_name=b_agent.name,
                    policy_name=binding.policy_name,
                    lora_name=binding.lora_name,
                    prompt_ids=prompt_ids,
                    response_ids=list(completion.token_ids),
                    logprobs=[float(x) for x in completion.logprobs],
                    prompt_text=prompt.messages[-1]["content"] if prompt.messages else "",
                    response_text=completion.text,
                    finish_reason=completion.finish_reason,
                    reward=float(b_agent.agent_reward or 0.0),
                    success=bool(b_agent.success),
                    info=dict(getattr(b_agent, "turn_info", None) or {}),
                    branch_idx=k,
                    continued=k == chosen,
                    sampling_seed=None if seed is None else int(seed) + k,
                    server=getattr(completion, "server", ""),
                    team_credit=credit.value,
                    lookahead=credit.calls,
                    scripted=scripted,
                    prefill=str(getattr(b_agent, "prefill", "") or ""),
                )
                for k, ((b_agent, _), completion, credit) in enumerate(zip(branches, completions, credits, strict=True))
            ]
            record.turns.extend(turn_records)
            path_tokens += len(completions[chosen].token_ids)
            if self.layout == "per_episode":
                seq[agent.name] = prompt_ids + list(completions[chosen].token_ids)
                last_messages[agent.name] = list(prompt.messages)
                last_turn[agent.name] = turn_records[chosen]
            if env.done:
                break
        # per-episode values an env reports once it is over (plan-path: the team reward), for every row
        episode_info = getattr(env, "episode_info", None)
        if callable(episode_info):
            record.info.update(episode_info())
        # done: the env ended the episode. truncated: it ended on a limit (turns, tokens), not by success or failure.
        record.done = bool(env.done) and not out_of_budget
        record.truncated = out_of_budget or bool(getattr(env, "truncated", False)) or not env.done
        # outcome: the env's (solved, failed, max_turns); the engine's own turn limit counts as max_turns; a
        # stop on the token budget or the context before the env ended it is not_finished
        record.outcome = NOT_FINISHED if out_of_budget else terminal_outcome(env) or MAX_TURNS
        return record

    def _room(self, agent: Any, prompt_ids: list[int], used_tokens: int) -> int:
        """New tokens the agent's next call may generate: its own ``max_tokens``, what the episode's token budget
        leaves after ``used_tokens``, and what the model context leaves after the prompt (<= 0: no room)."""
        room = min(agent.sampling.max_tokens, self.token_budget - used_tokens)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - len(prompt_ids))
        return room

    async def _generate(
        self, binding: AgentBinding, prompt_ids: list[int], sampling: dict[str, Any], n: int | None = None
    ) -> list[Any]:
        """The turn's candidates: one request for all K (vLLM seeds choice k with seed + k, so each candidate is
        reproducible); a single candidate (``n`` = 1: also a lookahead call) through ``complete_one``."""
        n = self.branches if n is None else n
        started = time.perf_counter()
        if n == 1:
            completions = [await binding.client.complete_one(prompt_ids, model=binding.served_model, **sampling)]
        else:
            completions = await binding.client.complete(prompt_ids, model=binding.served_model, n=n, **sampling)
        ended = time.perf_counter()
        self._llm_s += ended - started
        self._llm_spans.append((started - self._t0, ended - self._t0))
        return completions

    def _candidates(self, agent: Any, env: Any, k: int) -> list[tuple[Any, Any]]:
        """The (agent, env) pair each of the ``k`` candidates acts on. Tree mode: a fork each, so no candidate
        touches the episode or another candidate. Independent: the episode's own pair (one candidate)."""
        if not self.fork:
            return [(agent, env)]
        return [(_fork(agent, "agent"), _fork(env, "env")) for _ in range(k)]

    async def _step(self, branches: list[tuple[Any, Any]]) -> None:
        """Every candidate's env step, concurrently (tree: each on its own fork)."""
        started = time.perf_counter()
        await asyncio.gather(*(b_agent.step(b_env) for b_agent, b_env in branches))
        ended = time.perf_counter()
        self._env_s += ended - started
        self._env_spans.append((started - self._t0, ended - self._t0))

    async def _team_credits(
        self,
        branches: list[tuple[Any, Any]],
        completions: list[Any],
        agents: list[Any],
        position: int,
        turn: int,
        spec: EpisodeSpec,
        path_tokens: int,
    ) -> list[TeamCredit]:
        """Each candidate's team term (``team_credit``): none (``shared``), the team outcome on its fork right
        after its action (``step``), or after a lookahead on a further fork (``round``, ``episode``)."""
        if self.team_credit == "shared":
            return [TeamCredit() for _ in branches]
        if self.team_credit == "step":
            return [TeamCredit(_team_outcome(b_env, self.team_credit)) for _, b_env in branches]
        return list(
            await asyncio.gather(
                *(
                    self._lookahead(branches[k], agents, position, turn, spec, path_tokens + len(c.token_ids), k)
                    for k, c in enumerate(completions)
                )
            )
        )

    async def _lookahead(
        self,
        candidate: tuple[Any, Any],
        agents: list[Any],
        position: int,
        turn: int,
        spec: EpisodeSpec,
        used_tokens: int,
        branch: int,
    ) -> TeamCredit:
        """Play on from one candidate, on forks of its agent, its env and the other agents (nothing here touches
        the episode or another candidate): the other agents act once each (``round``) or until the episode ends
        (``episode``), within ``max_turns``, the model context and the episode's token budget (``used_tokens``:
        the path so far and the candidate's own reply). Returns the team outcome reached and the calls made."""
        b_agent, b_env = candidate
        env = _fork(b_env, "env")
        team = [_fork(b_agent if i == position else a, "agent") for i, a in enumerate(agents)]
        limit = len(agents) - 1 if self.team_credit == "round" else self.max_turns
        calls: list[dict[str, Any]] = []
        tokens = 0
        t = turn + 1
        while not env.done and t < self.max_turns and len(calls) < limit:
            agent = team[t % len(agents)]
            binding = self.bindings[agent.name]
            prompt_ids = list(agent.update_from_env(t, env).token_ids)
            max_tokens = self._room(agent, prompt_ids, used_tokens + tokens)
            if max_tokens <= 0:
                break
            sampling = self._sampling(agent, max_tokens, spec, t)
            sampling["temperature"] = self.lookahead_temperature
            sampling["seed"] = _derive_seed(spec.id.seed, spec.id.sample_idx, turn, "lookahead", branch, t)
            (completion,) = await self._generate(binding, prompt_ids, sampling, n=1)
            agent.update_from_model(t, env, completion.text)
            await self._step([(agent, env)])
            tokens += len(completion.token_ids)
            calls.append(
                {
                    "turn": t,
                    "agent": agent.name,
                    "response_ids": list(completion.token_ids),
                    "response_text": completion.text,
                    "finish_reason": completion.finish_reason,
                }
            )
            t += 1
        return TeamCredit(_team_outcome(env, self.team_credit), calls, tokens)

    def _choose(self, branches: list[tuple[Any, Any]], spec: EpisodeSpec, turn: int) -> int:
        """The candidate the episode continues from: the only one, or ``select_branch`` over their rewards
        (its RNG seeded per episode and turn, so a re-run picks the same branches)."""
        if len(branches) == 1:
            return 0
        rewards = [float(b_agent.agent_reward or 0.0) for b_agent, _ in branches]
        rng = random.Random(_derive_seed(spec.id.seed, "select", turn))
        return select_branch(rewards, self.tree_select, rng)

    def _extend_sequence(
        self,
        name: str,
        binding: AgentBinding,
        messages: list[dict[str, str]],
        seq: dict[str, list[int]],
        last_messages: dict[str, list[dict[str, str]]],
        last_turn: dict[str, TurnRecord],
    ) -> list[int]:
        """The next prompt of a per-episode agent: its sequence so far + the env tokens in between."""
        previous = last_messages[name]
        answered = len(previous) + 1
        if (
            messages[: len(previous)] != previous
            or len(messages) <= answered
            or messages[len(previous)]["role"] != "assistant"
        ):
            raise ValueError(
                f"agent {name!r} must return an append-only conversation in the per_episode layout "
                "(previous messages + its assistant answer + new observation messages)"
            )
        prev = last_turn[name]
        eos_id = getattr(binding.tokenizer, "eos_token_id", None)
        ended_eos = bool(prev.response_ids) and prev.response_ids[-1] == eos_id
        env_ids = env_tokens_between(binding.tokenizer, previous, prev.response_text, messages[answered:], ended_eos)
        prev.env_ids_after = env_ids
        return seq[name] + env_ids

    def _sampling(self, agent: Any, max_tokens: int, spec: EpisodeSpec, turn: int) -> dict[str, Any]:
        s = agent.sampling
        params = {
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "max_tokens": max_tokens,
            "stop": list(s.stop) or None,
            # different for each sample of a group, reproducible across re-runs
            "seed": _derive_seed(spec.id.seed, spec.id.sample_idx, turn),
        }
        params.update(self.sampling_overrides)
        if agent.name in self.agent_temperatures:
            params["temperature"] = self.agent_temperatures[agent.name]
        return params

    # ------------------------------------------------------------------ many episodes
    async def run(
        self, specs: Sequence[EpisodeSpec], on_episode: Callable[[EpisodeRecord], None] | None = None
    ) -> tuple[list[EpisodeRecord], EngineStats]:
        """All episodes concurrently; results in the order of ``specs``. ``on_episode`` sees each finished
        episode at once (the rollouts step commits whole groups with it while the others still run)."""
        self._llm_s = self._env_s = 0.0
        self._llm_spans, self._env_spans = [], []
        started = self._t0 = time.perf_counter()
        progress = _Progress(len(specs), enabled=self.show_progress)

        async def one(spec: EpisodeSpec) -> EpisodeRecord:
            rec = await self.run_episode(spec)
            progress.advance(rec.tokens_generated)
            if on_episode is not None:
                on_episode(rec)
            return rec

        try:
            records = await asyncio.gather(*(one(s) for s in specs))
        finally:
            progress.close()
        stats = summarize(records)
        stats.wall_s = time.perf_counter() - started
        stats.llm_s, stats.env_s = self._llm_s, self._env_s
        stats.llm_spans, stats.env_spans = list(self._llm_spans), list(self._env_spans)
        return list(records), stats


def timeline(stats: EngineStats) -> dict[str, float]:
    """Where a round's wall time went, from the spans ``run`` recorded (seconds after its start).

    ``first_request_s``: until the first LLM call was made (env and agent set-up, prompt building,
    tokenization). ``all_sent_s``: until the last call of the first wave was made (one per episode
    started in the first 10 % of the round). ``last_token_s``: until the last LLM call returned.
    ``after_last_token_s``: wall time after it (the env steps of the last episodes, e.g. the sandbox).
    ``tail_s``: the stretch before the last token during which at most a quarter of the peak number of
    requests was in flight. ``mean_in_flight``: time-weighted mean of requests in flight between the first
    call and the last token; ``peak_in_flight``. ``env_after_last_token_s``: env time (summed over
    episodes) that ran after the last token.
    """
    spans = sorted(stats.llm_spans)
    if not spans:
        return {}
    first = spans[0][0]
    last = max(end for _, end in spans)
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    in_flight = peak = 0
    area = 0.0
    prev = first
    profile: list[tuple[float, int]] = []  # (time, requests in flight from then on)
    for t, delta in events:
        area += in_flight * (t - prev)
        prev = t
        in_flight += delta
        peak = max(peak, in_flight)
        profile.append((t, in_flight))
    low = peak / 4
    tail_start = last
    for t, n in reversed(profile):
        if n > low:
            break
        tail_start = t
    window = first + 0.1 * (last - first)
    return {
        "first_request_s": first,
        "all_sent_s": max((s for s, _ in spans if s <= window), default=first),
        "last_token_s": last,
        "after_last_token_s": max(stats.wall_s - last, 0.0),
        "tail_s": last - tail_start,
        "mean_in_flight": area / (last - first) if last > first else float(peak),
        "peak_in_flight": float(peak),
        "env_after_last_token_s": sum(max(0.0, e - max(s, last)) for s, e in stats.env_spans),
    }


def summarize(records: Sequence[EpisodeRecord]) -> EngineStats:
    """Reward mean/std and success rate per agent over every episode of its team (its final turn on the episode's
    path; an episode that ended before its turn counts as reward 0, no success: ``records.agent_scores``), how
    the episodes ended (``outcomes``), tokens (every generated token, all tree candidates included), turns (of
    the path); the same per env."""
    stats = EngineStats(episodes=len(records))
    stats.outcomes = outcome_counts([rec.outcome for rec in records])
    finals: dict[str, list[tuple[float, bool] | None]] = {}
    by_env: dict[str, dict[str, list[tuple[float, bool] | None]]] = {}
    for rec in records:
        stats.turns += sum(t.continued for t in rec.turns)  # the episode's length (tree: its path)
        stats.tokens_generated += rec.tokens_generated
        stats.lookahead_tokens += rec.lookahead_tokens
        env = stats.per_env.setdefault(rec.id.env_name, {"episodes": 0, "tokens_generated": 0})
        env["episodes"] += 1
        env["tokens_generated"] += rec.tokens_generated
        # the episode's team (records of tests or older code without one: the agents that acted)
        for name in dict.fromkeys([*rec.team, *(t.agent_name for t in rec.turns)]):
            final = rec.final(name)
            finals.setdefault(name, []).append(final)
            by_env.setdefault(rec.id.env_name, {}).setdefault(name, []).append(final)
    for name, values in finals.items():
        stats.per_agent[name] = agent_scores(values)
    for env_name, agents in by_env.items():
        stats.per_env[env_name]["agents"] = {name: agent_scores(values) for name, values in agents.items()}
    return stats


class _Progress:
    """A rich progress bar on a terminal; periodic log lines elsewhere (Prefect logs, CI)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.tokens = total, 0, 0
        self.started = time.perf_counter()
        self._bar = None
        self._next_log = 0.0
        if enabled and total and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("rollouts"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[tok]} tok"),
                TimeElapsedColumn(),
                transient=False,
            )
            self._task = self._bar.add_task("rollouts", total=total, tok=0)
            self._bar.start()
        self.enabled = enabled

    def advance(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(self._task, advance=1, tok=self.tokens)
        elif self.enabled:
            now = time.perf_counter()
            if now >= self._next_log or self.done == self.total:
                elapsed = now - self.started
                log.info("rollouts %d/%d episodes, %d tokens, %.0f s", self.done, self.total, self.tokens, elapsed)
                self._next_log = now + 10.0

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
