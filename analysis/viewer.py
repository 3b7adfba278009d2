"""What the trajectory viewer shows, as plain data: episodes, turns, tokens, attempts side by side.

``pettingflow trajectories view`` (``analysis/viewer_app.py``) renders these with Jinja2 templates; keeping
the reading and shaping here means the rules (which advantage belongs to which row, how a token is shaded,
which candidate continued) are tested without a web server. Nothing here writes.

Rows come from an iteration's ``rollouts`` step (or ``validation`` / ``baseline``). A re-run attempt reuses
the original's rollouts and has its own ``filtered`` / ``advantages``: the advantage a row trained with is
looked up in the attempt's ``advantages`` step by the row's identity (episode, turn, agent, candidate); a row
absent there was dropped by the filter.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pettingflow.analysis.inspect import episode_outcome
from pettingflow.steps.report import REPORT_STEP, read_metrics
from pettingflow.storage import RunLayout, read_step_trajectories
from pettingflow.storage.layout import StepName

ROW_KEY = ("rollout_idx", "turn_idx", "agent_idx", "branch_idx")
DEFAULT_PORT = 8765
VIEW_STEPS = (StepName.ROLLOUTS, StepName.VALIDATION, StepName.BASELINE)
TokenDecoder = Callable[[str, Sequence[int]], list[str] | None]


@dataclass(frozen=True)
class Token:
    """One response token: its text, whether the model sampled it (mask 1) and its shading in [-1, 1]."""

    text: str
    model: bool
    shade: float
    logprob: float


@dataclass
class Turn:
    """One row: an agent's call, with what it saw, what it answered and what it was credited."""

    turn_idx: int
    agent: str
    policy: str
    lora: str | None
    version: int
    reward: float
    success: bool
    advantage: float | None  # None: no advantages step, or the filter dropped the row
    trained: bool | None  # None: no filtered step to say
    uid: str
    branch: int
    continued: bool
    prompt: str
    response: str
    tokens: list[Token] | None  # None: the tokenizer is not available here; the response text is shown whole
    model_tokens: int
    env_tokens: int
    info: dict[str, Any] = field(default_factory=dict)
    prefill: str = ""  # the reply's start, written by the prompt (answer_prefix): shown before it, marked


@dataclass
class Episode:
    """One episode (``rollout_idx``) of an iteration, its turns in order (tree candidates side by side)."""

    index: int
    env: str
    group: str
    sample: int
    outcome: str  # how it ended, in words (analysis/outcomes.py LABELS): solved, failed, ended at max turns, ...
    info: dict[str, Any]
    turns: list[Turn]

    @property
    def agents(self) -> list[str]:
        return sorted({t.agent for t in self.turns})

    def final_rewards(self) -> dict[str, float]:
        """Each agent's reward at its last turn on the episode's path: its outcome for the episode."""
        out: dict[str, float] = {}
        for t in sorted(self.turns, key=lambda t: t.turn_idx):
            if t.continued:
                out[t.agent] = t.reward
        return out


def _key(row: dict[str, Any]) -> tuple[int, int, int, int]:
    return tuple(int(row.get(k) or 0) for k in ROW_KEY)  # type: ignore[return-value]


def advantage_index(layout: RunLayout, iteration: int, attempt: int) -> tuple[dict[tuple, float] | None, set | None]:
    """(row key -> advantage, keys the filter kept) of an attempt; None where its step is not committed.

    An attempt that re-ran from ``advantages`` has no ``filtered`` of its own: the original's is the one it used.
    """

    def committed(name: str):
        for a in (attempt, 0) if attempt else (0,):
            step = layout.step(iteration, name, a)
            if step.is_committed():
                return step
        return None

    advantages = committed(StepName.ADVANTAGES)
    filtered = committed(StepName.FILTERED)
    adv = None
    if advantages is not None:
        table = read_step_trajectories(advantages)
        if "advantage" in table.column_names:
            adv = {_key(r): float(r["advantage"]) for r in table.select([*ROW_KEY, "advantage"]).to_pylist()}
    kept = None
    if filtered is not None:
        kept = {_key(r) for r in read_step_trajectories(filtered, columns=list(ROW_KEY)).to_pylist()}
    return adv, kept


def shade(advantage: float | None, scale: float) -> float:
    """An advantage mapped to [-1, 1] for colouring: its sign, and its size relative to the batch's largest."""
    if advantage is None or scale <= 0:
        return 0.0
    return max(-1.0, min(1.0, advantage / scale))


def tokens_of(
    row: dict[str, Any], pieces: list[str] | None, advantage: float | None, scale: float
) -> list[Token] | None:
    """The response as tokens: model tokens shaded by the row's advantage, env tokens (mask 0) unshaded."""
    if pieces is None:
        return None
    mask = row["response_mask"]
    logprobs = row.get("sampler_logprobs") or [0.0] * len(mask)
    s = shade(advantage, scale)
    return [
        Token(text=p, model=bool(m), shade=s if m else 0.0, logprob=float(lp))
        for p, m, lp in zip(pieces, mask, logprobs, strict=True)
    ]


def load_episodes(
    layout: RunLayout,
    iteration: int,
    attempt: int = 0,
    step: str = StepName.ROLLOUTS,
    decode: TokenDecoder | None = None,
    episode: int | None = None,
) -> list[Episode]:
    """Every episode of an iteration's ``step`` (or only ``episode``), with each row's advantage under ``attempt``.

    ``decode(policy, ids)`` gives the text of each token (None when no tokenizer); only asked for when one
    episode is read, since a page of many episodes shows no tokens."""
    import pyarrow.compute as pc

    if step not in VIEW_STEPS:
        raise ValueError(f"step {step!r}: the viewer shows one of {', '.join(VIEW_STEPS)}")
    table = read_step_trajectories(layout.step(iteration, step))
    if episode is not None:
        table = table.filter(pc.equal(table.column("rollout_idx"), episode))
    adv, kept = advantage_index(layout, iteration, attempt) if step == StepName.ROLLOUTS else (None, None)
    scale = max((abs(v) for v in adv.values()), default=0.0) if adv else 0.0
    by_episode: dict[int, list[dict[str, Any]]] = {}
    for row in table.to_pylist():
        by_episode.setdefault(int(row["rollout_idx"]), []).append(row)
    episodes = []
    for idx in sorted(by_episode):
        rows = sorted(by_episode[idx], key=lambda r: (r["turn_idx"], r.get("branch_idx", 0)))
        first = rows[0]
        infos = [json.loads(row["info_json"] or "{}") for row in rows]
        turns = []
        for row, info in zip(rows, infos, strict=True):
            key = _key(row)
            advantage = adv.get(key) if adv is not None else None
            pieces = decode(row["policy_name"], row["response_ids"]) if decode and episode is not None else None
            mask = row["response_mask"]
            turns.append(
                Turn(
                    turn_idx=row["turn_idx"],
                    agent=row["agent_name"],
                    policy=row["policy_name"],
                    lora=row["lora_name"],
                    version=int(row.get("policy_version") or 0),
                    reward=float(row["reward"]),
                    success=bool(row["success"]),
                    advantage=advantage,
                    trained=(key in kept) if kept is not None else None,
                    uid=row["uid"],
                    branch=int(row.get("branch_idx") or 0),
                    continued=bool(row.get("continued", True)),
                    prompt=row["prompt_text"],
                    response=row["response_text"],
                    tokens=tokens_of(row, pieces, advantage, scale),
                    model_tokens=sum(mask),
                    env_tokens=len(mask) - sum(mask),
                    info=info.get("turn") or {},
                    prefill=row.get("prefill") or "",
                )
            )
        episodes.append(
            Episode(
                index=idx,
                env=first["env_name"],
                group=first["group_id"],
                sample=int(first["sample_idx"]),
                outcome=episode_outcome(first),
                info={k: v for k, v in infos[0].items() if k != "turn"},
                turns=turns,
            )
        )
    return episodes


@dataclass(frozen=True)
class EpisodeFilter:
    """What the episode list is narrowed to; empty fields do not filter."""

    agent: str = ""
    env: str = ""
    min_reward: float | None = None
    max_reward: float | None = None
    outcome: str = ""

    def keeps(self, episode: Episode) -> bool:
        if self.agent and self.agent not in episode.agents:
            return False
        if self.env and episode.env != self.env:
            return False
        if self.outcome and episode.outcome != self.outcome:
            return False
        rewards = episode.final_rewards()
        if self.agent:
            rewards = {self.agent: rewards.get(self.agent, 0.0)}
        best = max(rewards.values(), default=0.0)
        if self.min_reward is not None and best < self.min_reward:
            return False
        return not (self.max_reward is not None and best > self.max_reward)


def attempt_summary(layout: RunLayout, iteration: int, attempt: int) -> dict[str, Any]:
    """An attempt's overrides (a re-run's ``attempt.json``) and its report metrics (empty before its report)."""
    info = layout.read_attempt_info(iteration, attempt) or {}
    report = layout.step(iteration, REPORT_STEP, attempt)
    metrics = read_metrics(report) if report.is_committed() else {}
    return {
        "attempt": attempt,
        "overrides": info.get("overrides") or [],
        "from_step": info.get("from_step", ""),
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, int | float)},
    }


def compare_attempts(layout: RunLayout, iteration: int, a: int, b: int) -> dict[str, Any]:
    """Two attempts of one iteration side by side: overrides, every metric of either, and each row's advantage.

    Why: a re-run changes settings, not trajectories, so the question is which rows it credited differently
    and what that did to the update's numbers."""
    left, right = attempt_summary(layout, iteration, a), attempt_summary(layout, iteration, b)
    names = sorted(set(left["metrics"]) | set(right["metrics"]))
    metrics = [(n, left["metrics"].get(n), right["metrics"].get(n)) for n in names]
    adv_a, kept_a = advantage_index(layout, iteration, a)
    adv_b, kept_b = advantage_index(layout, iteration, b)
    rows = read_step_trajectories(
        layout.step(iteration, StepName.ROLLOUTS), columns=[*ROW_KEY, "agent_name", "reward"]
    ).to_pylist()
    pairs = []
    for row in sorted(rows, key=_key):
        key = _key(row)
        pairs.append(
            {
                "episode": key[0],
                "turn": key[1],
                "agent": row["agent_name"],
                "branch": key[3],
                "reward": float(row["reward"]),
                "a": (adv_a or {}).get(key),
                "b": (adv_b or {}).get(key),
                "kept_a": kept_a is None or key in kept_a,
                "kept_b": kept_b is None or key in kept_b,
            }
        )
    return {"left": left, "right": right, "metrics": metrics, "rows": pairs}


def run_overview(layout: RunLayout) -> dict[str, Any]:
    """What every page's header shows: the run's id, its config name and its iterations."""
    info = layout.read_run_info()
    return {"run_id": layout.run_id, "config": info.get("config_name", ""), "iterations": layout.iterations()}


def viewer_markdown(run_id: str, iteration: int, attempt: int = 0, port: int = DEFAULT_PORT) -> str:
    """The report artifact's pointer to this iteration in the viewer: the command that serves it, and the link."""
    query = f"?attempt={attempt}" if attempt else ""
    url = f"http://127.0.0.1:{port}/iteration/{iteration}{query}"
    return (
        f"Every episode turn by turn: run `pettingflow trajectories view {run_id} -k {iteration}` on this machine, "
        f"then open [{url}]({url})."
    )
