"""What an episode leaves behind, and how it becomes training rows in either sample layout.

Two layouts (docs/architecture.md, storage):

- ``per_turn`` (PettingLLMs): every agent call is one sample. ``prompt_ids`` is the prompt
  the sampler saw, ``response_ids`` the tokens it generated, all masked 1. The UID groups the G
  samples of one task at the same turn for the same agent.
- ``per_episode`` (verl's multi-turn recipe, MLGym): one sample per agent per episode. ``prompt_ids`` is the
  agent's first prompt; ``response_ids`` concatenates its actions (mask 1) with the environment tokens
  that came between them (mask 0), exactly as the sampler saw the sequence. The UID groups the G
  samples of one task for the same agent (turn_idx is 0 for these rows).

Tree episodes (``rollout.mode: tree``) give one row per candidate in both layouts: the K
(``rollout.tree.branches``) candidates of a (task, turn, agent) share the prompt and the UID (tree mode runs one
episode per task, ``group_size`` 1, so ``rollout_idx`` is the task and the UID key ``(env_idx, turn_idx,
agent_idx)``, by the same rule as independent rows); ``branch_idx`` says which candidate a row is and ``continued``
whether the episode went on from it. In the per_episode layout the prompt of a tree row is the agent's whole
sequence along the continued path (earlier actions and the env tokens between them, exactly as the sampler
saw it), so the continued path is the episode and only the candidate's own tokens are trained.

Token ids are never re-derived from decoded text: rows carry the exact ids the sampler returned.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pettingflow.envs.base import NOT_FINISHED
from pettingflow.rl.uids import assign_uids


@dataclass
class TurnRecord:
    """One agent call inside an episode."""

    turn_idx: int
    agent_idx: int
    agent_name: str
    policy_name: str
    lora_name: str | None
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    prompt_text: str
    response_text: str
    finish_reason: str
    reward: float = 0.0
    success: bool = False
    # per_episode layout: env tokens between this action and the same agent's next prompt
    env_ids_after: list[int] = field(default_factory=list)
    # the agent's ``turn_info`` (e.g. per-turn reward parts); stored as info_json["turn"] of the row
    info: dict[str, Any] = field(default_factory=dict)
    # tree rollouts: which of the K candidates of this turn, and whether the episode continued from it
    branch_idx: int = 0
    continued: bool = True
    # the sampling seed of this call (tree: the request's seed + branch_idx, as vLLM seeds choice k)
    sampling_seed: int | None = None
    # the inference server (replica) that generated it; "" when the client does not say
    server: str = ""
    # tree team credit (``rollout.tree.team_credit`` other than shared): this candidate's own team term, and the
    # lookahead calls behind it (stored in info_json, never trained on)
    team_credit: float | None = None
    lookahead: list[dict[str, Any]] = field(default_factory=list)
    # a scripted agent's turn (``Agent.scripted``): no model tokens; on the episode's path, never a training row
    scripted: bool = False
    # the agent's answer_prefix of this turn: the reply's start, written by the prompt (its tokens end prompt_ids)
    prefill: str = ""


@dataclass(frozen=True)
class EpisodeId:
    """Which episode: the identity an ``EpisodeSpec`` asks for and its ``EpisodeRecord`` carries into every row.

    ``rollout_idx = env_idx * group_size + sample_idx``, so ``rollout_idx // group_size`` is the group
    (PettingLLMs' UID rule); ``seed`` is the env's reset seed, the same for every sample of a group.
    """

    env_name: str
    env_idx: int
    group_id: str
    sample_idx: int
    rollout_idx: int
    seed: int


@dataclass
class EpisodeRecord:
    """One multi-turn episode: a sample of a GRPO group."""

    id: EpisodeId
    turns: list[TurnRecord] = field(default_factory=list)
    done: bool = False
    truncated: bool = False
    # how it ended: solved, failed, max_turns (the env's ``outcome``) or not_finished (stopped on the token budget
    # or the model context before the env ended it); the ``outcome`` column of every row
    outcome: str = NOT_FINISHED
    # the agents that take turns in this episode's env (``Agent.acts_in``): each is scored on every episode of
    # its env, also one that ended before its turn (``final``)
    team: list[str] = field(default_factory=list)
    tokens_generated: int = 0
    # the env's ``episode_info()`` at the end (e.g. the team reward); merged into every row's info_json
    info: dict[str, Any] = field(default_factory=dict)
    # a tree episode: ``turns`` holds K candidates per turn, of which one per turn is ``continued``
    tree: bool = False
    # how tree candidates got their team term (``rollout.tree.team_credit``); of ``tokens_generated``, the lookahead's
    team_credit: str = "shared"
    lookahead_tokens: int = 0

    def path(self) -> list[TurnRecord]:
        """The turns the episode actually took (tree: the continued candidates; otherwise every turn)."""
        return [t for t in self.turns if t.continued]

    def final_reward(self, agent_name: str) -> float:
        """The agent's reward at its last turn on the episode's path: its outcome for the episode."""
        for turn in reversed(self.path()):
            if turn.agent_name == agent_name:
                return turn.reward
        return 0.0

    def final_success(self, agent_name: str) -> bool:
        for turn in reversed(self.path()):
            if turn.agent_name == agent_name:
                return turn.success
        return False

    def final(self, agent_name: str) -> tuple[float, bool] | None:
        """The agent's (reward, success) at its last turn on the path; None where it never acted (the episode
        ended before its turn): ``agent_scores`` counts that as reward 0 and no success."""
        for turn in reversed(self.path()):
            if turn.agent_name == agent_name:
                return turn.reward, turn.success
        return None


def _base_row(run_id: str, iteration: int, ep: EpisodeRecord) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "iteration": iteration,
        "env_name": ep.id.env_name,
        "env_idx": ep.id.env_idx,
        "group_id": ep.id.group_id,
        "sample_idx": ep.id.sample_idx,
        "rollout_idx": ep.id.rollout_idx,
        "done": ep.done,
        "truncated": ep.truncated,
        "outcome": ep.outcome,
    }


def per_turn_rows(episodes: list[EpisodeRecord], run_id: str, iteration: int, group_size: int) -> list[dict[str, Any]]:
    """One row per agent call (tree: per candidate); UID from (rollout_idx // group_size, turn_idx, agent_idx)
    (PettingLLMs' trainer). ``group_size``: the episodes per task; tree episodes run one per task, so their group
    is the K candidates of one episode's turn."""
    rows: list[dict[str, Any]] = []
    for ep in episodes:
        for turn in ep.turns:
            if turn.scripted:
                continue
            row = _base_row(run_id, iteration, ep)
            row.update(
                turn_idx=turn.turn_idx,
                agent_idx=turn.agent_idx,
                agent_name=turn.agent_name,
                policy_name=turn.policy_name,
                lora_name=turn.lora_name,
                prompt_ids=list(turn.prompt_ids),
                response_ids=list(turn.response_ids),
                response_mask=[1] * len(turn.response_ids),
                sampler_logprobs=list(turn.logprobs),
                reward=float(turn.reward),
                final_reward=float(ep.final_reward(turn.agent_name)),
                success=bool(turn.success),
                prompt_text=turn.prompt_text,
                response_text=turn.response_text,
                prefill=turn.prefill,
                branch_idx=turn.branch_idx,
                continued=turn.continued,
                inference_server=turn.server or None,
                info_json=json.dumps(
                    {
                        "finish_reason": turn.finish_reason,
                        "seed": ep.id.seed,
                        **({"sampling_seed": turn.sampling_seed} if turn.sampling_seed is not None else {}),
                        **ep.info,
                        **({"turn": turn.info} if turn.info else {}),
                        **_team_credit_info(ep, turn),
                    },
                    default=str,
                ),
            )
            rows.append(row)
    _attach_uids(rows, group_size, namespace=f"{run_id}/{iteration}")
    return rows


def _team_credit_info(ep: EpisodeRecord, turn: TurnRecord) -> dict[str, Any]:
    """A tree candidate's own team term replaces the episode's ``team_reward`` (kept as ``episode_team_reward``),
    so reward mixing (``steps/batches.py``) credits each candidate with what it led to; its lookahead is stored."""
    if turn.team_credit is None:
        return {}
    return {
        "team_reward": turn.team_credit,
        "episode_team_reward": ep.info.get("team_reward"),
        "team_credit": ep.team_credit,
        **({"lookahead": turn.lookahead} if turn.lookahead else {}),
    }


def per_episode_rows(
    episodes: list[EpisodeRecord], run_id: str, iteration: int, group_size: int
) -> list[dict[str, Any]]:
    """One row per agent per episode: actions masked 1, env tokens between them masked 0 (verl's multi-turn recipe)."""
    rows: list[dict[str, Any]] = []
    for ep in episodes:
        agents: dict[str, list[TurnRecord]] = {}
        for turn in ep.path():
            if not turn.scripted:
                agents.setdefault(turn.agent_name, []).append(turn)
        for name, turns in agents.items():
            response_ids: list[int] = []
            mask: list[int] = []
            logprobs: list[float] = []
            texts: list[str] = []
            for i, turn in enumerate(turns):
                response_ids += turn.response_ids
                mask += [1] * len(turn.response_ids)
                logprobs += turn.logprobs
                texts.append(turn.response_text)
                if i < len(turns) - 1:  # env tokens only *between* actions: nothing trails the last one
                    response_ids += turn.env_ids_after
                    mask += [0] * len(turn.env_ids_after)
                    logprobs += [0.0] * len(turn.env_ids_after)
            first, last = turns[0], turns[-1]
            row = _base_row(run_id, iteration, ep)
            row.update(
                turn_idx=0,
                agent_idx=first.agent_idx,
                agent_name=name,
                policy_name=first.policy_name,
                lora_name=first.lora_name,
                prompt_ids=list(first.prompt_ids),
                response_ids=response_ids,
                response_mask=mask,
                sampler_logprobs=logprobs,
                reward=float(last.reward),
                final_reward=float(last.reward),
                success=bool(last.success),
                prompt_text=first.prompt_text,
                response_text="\n<<turn>>\n".join(texts),
                prefill="",  # answer_prefix needs the per_turn layout
                branch_idx=0,
                continued=True,
                inference_server=last.server or None,  # a failover mid-episode: the servers are in info_json
                info_json=json.dumps(
                    {
                        "turns": [t.turn_idx for t in turns],
                        **({"servers": [t.server for t in turns]} if len({t.server for t in turns}) > 1 else {}),
                        "finish_reasons": [t.finish_reason for t in turns],
                        "seed": ep.id.seed,
                        **ep.info,
                        **({"turn_infos": [t.info for t in turns]} if any(t.info for t in turns) else {}),
                    },
                    default=str,
                ),
            )
            rows.append(row)
    _attach_uids(rows, group_size, namespace=f"{run_id}/{iteration}")
    return rows


def build_rows(
    episodes: list[EpisodeRecord],
    layout: str,
    run_id: str,
    iteration: int,
    group_size: int,
    policy_versions: Mapping[str, int] | None = None,
) -> list[dict[str, Any]]:
    """Rows in the configured sample layout (``per_turn`` or ``per_episode``); tree episodes: one row per
    candidate in either layout (module docstring). ``group_size``: the episodes per task the records were run
    with (``env.group_size``; 1 for tree episodes), which the UIDs group by.

    ``policy_versions``: policy -> version of the weights that generated its rows (``policy_version`` column);
    None: ``iteration`` for every policy (sync rollouts, every earlier iteration updated).
    """
    trees = {ep.tree for ep in episodes}
    if len(trees) > 1:
        raise ValueError("build_rows got tree and independent episodes together; their UIDs follow different rules")
    if layout not in ("per_turn", "per_episode"):
        raise ValueError(f"unknown sample layout {layout!r}; use per_turn or per_episode")
    if trees == {True} and group_size != 1:
        raise ValueError(
            f"build_rows got tree episodes with group_size={group_size}; tree mode runs one episode per task, so "
            "pass group_size=1 (the episodes per task, env.group_size), not the candidates per turn "
            "(rollout.tree.branches)"
        )
    # tree episodes: one row per candidate in both layouts, the group is one episode's turn
    if trees == {True} or layout == "per_turn":
        rows = per_turn_rows(episodes, run_id, iteration, group_size)
    else:
        rows = per_episode_rows(episodes, run_id, iteration, group_size)
    for row in rows:
        row["policy_version"] = iteration if policy_versions is None else policy_versions[row["policy_name"]]
    return rows


def _attach_uids(rows: list[dict[str, Any]], group_size: int, namespace: str) -> None:
    uids = assign_uids(
        [r["rollout_idx"] for r in rows],
        [r["turn_idx"] for r in rows],
        [r["agent_idx"] for r in rows],
        sample_num=group_size,
        namespace=namespace,
    )
    for row, uid in zip(rows, uids, strict=True):
        row["uid"] = uid


def agent_scores(finals: Sequence[tuple[float, bool] | None]) -> dict[str, float]:
    """An agent's scores over every episode it takes part in: its final turn's ``(reward, success)`` per episode,
    None for an episode that ended before its turn. Reward mean and (population) std, success rate, ``episodes``
    (all of them) and ``episodes_acted`` (those with a turn of the agent).

    Why every episode: an episode the env ended before the agent's turn (a failure of its teammate, or a token
    budget spent) is still an episode the config asked for. Dropping it would raise the success rate of exactly
    the runs whose teammates fail most; it counts as reward 0 and no success. One definition for rollout stats,
    evaluations and the reports (``analysis/outcomes.py``)."""
    n = len(finals)
    acted = [f for f in finals if f is not None]
    if n == 0:
        nan = float("nan")
        return {"reward_mean": nan, "reward_std": nan, "success_rate": nan, "episodes": 0.0, "episodes_acted": 0.0}
    rewards = [float(f[0]) if f is not None else 0.0 for f in finals]
    mean = sum(rewards) / n
    return {
        "reward_mean": mean,
        "reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "success_rate": sum(bool(f[1]) for f in acted) / n,
        "episodes": float(n),
        "episodes_acted": float(len(acted)),
    }


def outcome_counts(outcomes: Sequence[str]) -> dict[str, float]:
    """How many episodes ended each way (every label of ``envs.base.OUTCOMES``, 0 included), for the step
    metrics (``<step>/outcomes/<label>``): the counts add up to the episodes that ran."""
    from pettingflow.envs.base import OUTCOMES

    unknown = sorted(set(outcomes) - set(OUTCOMES))
    if unknown:
        raise ValueError(f"episode outcomes {unknown} are not among {OUTCOMES}")
    return {label: float(sum(o == label for o in outcomes)) for label in OUTCOMES}
