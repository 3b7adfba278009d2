"""One definition of an episode's outcome for stored rows: every episode the config asked for counts.

An episode is one sample of one task: ``(env_idx, sample_idx)`` of a step. What a step *asked for* is its tasks
(the ``tasks`` of its manifest metadata) times its samples per task (``samples_per_task`` there; for steps stored
before it, the config's ``validation.samples_per_task`` or ``env.group_size``, 1 in tree mode).

- **How it ended**: the ``outcome`` column (``envs.base.OUTCOMES``: solved, failed, max_turns, not_finished;
  derived from ``done``/``truncated`` for files before it, see ``storage/schema.py``). An asked episode that left
  no row at all (every turn scripted, or the token budget spent before the first call) is ``no_rows``.
- **An agent's result**: its last turn on the episode's path (tree rows: the continued candidates). An episode
  that ended before the agent's turn (the env ended it, or it left no row) is reward 0 and no success: it is
  counted, never dropped (``rollout.records.agent_scores``, the same rule the engine's metrics use).
- **The episode's success** (held-out success, the learning reports): the result of the agent that decides the
  outcome (``analysis.learning.outcome_agent``) under that rule.

Why one module: validation, the training metrics, the run summary, ``runs show``, ``trajectories`` and the viewer
must agree on what a success rate is over; a rate that leaves out the episodes the env ended early inflates it
exactly where a teammate fails most.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pettingflow.envs.base import FAILED, MAX_TURNS, NOT_FINISHED, OUTCOMES, SOLVED
from pettingflow.rollout import records
from pettingflow.storage.layout import StepName
from pettingflow.storage.schema import derived_outcomes

#: outcome label -> how people read it (the episode printout, the viewer's column and filter)
LABELS: dict[str, str] = {
    SOLVED: "solved",
    FAILED: "failed",
    MAX_TURNS: "ended at max turns",
    NOT_FINISHED: "not finished",
}
NO_ROWS = "no_rows"  # an asked episode with no stored row: nothing says how it ended

Episode = tuple[int, int]  # (env_idx: the task's position in the step, sample_idx)


def outcome_label(outcome: str | None) -> str:
    """The words for an ``outcome`` value; an unknown value is shown as it is (never silently as solved)."""
    return LABELS.get(outcome or "", outcome or "unknown")


def row_outcome(row: Mapping[str, Any]) -> str:
    """A row's ``outcome``; for a row without the column (read by hand from an old file), derived from ``done`` and
    ``truncated`` as ``storage.schema.derived_outcomes`` does."""
    outcome = row.get("outcome")
    if outcome:
        return str(outcome)
    return derived_outcomes([bool(row["done"])], [bool(row["truncated"])])[0]


def asked_episodes(tasks: int, samples_per_task: int) -> list[Episode]:
    """Every episode a step asked for: each task position times each sample, in order."""
    if tasks < 0 or samples_per_task < 1:
        raise ValueError(f"a step asks for tasks >= 0 and samples_per_task >= 1, got {tasks} and {samples_per_task}")
    return [(t, s) for t in range(tasks) for s in range(samples_per_task)]


def path_rows(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows on their episode's path: every row of independent rollouts, the continued candidates of tree ones."""
    return [r for r in rows if r.get("continued", True)]


def last_turns(rows: Iterable[Mapping[str, Any]]) -> dict[tuple[str, int, int], Mapping[str, Any]]:
    """(agent, task position ``env_idx``, sample) -> the agent's last turn on that episode's path."""
    last: dict[tuple[str, int, int], Mapping[str, Any]] = {}
    for row in path_rows(rows):
        key = (row["agent_name"], int(row["env_idx"]), int(row["sample_idx"]))
        if key not in last or row["turn_idx"] > last[key]["turn_idx"]:
            last[key] = row
    return last


def episodes_of(rows: Iterable[Mapping[str, Any]], asked: Sequence[Episode] | None) -> list[Episode]:
    """``asked`` where known, plus any episode the rows hold beyond it (never fewer than ran); else the rows'."""
    seen = sorted({(int(r["env_idx"]), int(r["sample_idx"])) for r in rows})
    if asked is None:
        return seen
    extra = sorted(set(seen) - set(asked))
    return [*asked, *extra]


def episode_successes(
    rows: Sequence[Mapping[str, Any]], agent: str, asked: Sequence[Episode] | None = None
) -> dict[int, list[bool]]:
    """Task position -> the agent's final success in each episode of that task (sample order), over every asked
    episode: False where the agent had no turn. ``asked`` None: the episodes the rows hold (older callers)."""
    last = last_turns(rows)
    out: dict[int, list[bool]] = {}
    for task, sample in episodes_of(rows, asked):
        row = last.get((agent, task, sample))
        out.setdefault(task, []).append(bool(row["success"]) if row is not None else False)
    return out


def agent_scores(
    rows: Sequence[Mapping[str, Any]], asked: Sequence[Episode] | None = None
) -> dict[str, dict[str, float]]:
    """Per agent, ``rollout.records.agent_scores`` over every episode of its env: its final turn, or nothing (reward
    0, no success) where the episode ended before its turn. An agent belongs to the episodes of the envs it acted
    in anywhere in the rows (a mixed-env step: each env's team); an episode without rows counts for every agent."""
    last = last_turns(rows)
    env_of: dict[Episode, str] = {}
    team: dict[str, set[str]] = {}
    for row in rows:
        env_of[(int(row["env_idx"]), int(row["sample_idx"]))] = row["env_name"]
        team.setdefault(row["env_name"], set()).add(row["agent_name"])
    agents = sorted({name for names in team.values() for name in names})
    finals: dict[str, list[tuple[float, bool] | None]] = {a: [] for a in agents}
    for task, sample in episodes_of(rows, asked):
        env = env_of.get((task, sample))
        for agent in agents:
            if env is not None and agent not in team[env]:
                continue
            row = last.get((agent, task, sample))
            finals[agent].append(None if row is None else (float(row["reward"]), bool(row["success"])))
    return {agent: records.agent_scores(values) for agent, values in finals.items()}


@dataclass
class EpisodeCounts:
    """What a step asked for and what its rows show, adding up: ``episodes = sum(outcomes.values())`` and
    ``episodes = agent_acted + ended_before_agent``."""

    tasks: int  # tasks asked for
    samples_per_task: int
    episodes: int  # asked for (tasks x samples), plus any the rows hold beyond it
    agent: str  # the agent whose turns are counted (the outcome agent)
    agent_acted: int  # episodes with a turn of ``agent``
    ended_before_agent: int  # episodes without one: failures, counted
    successes: int  # episodes whose ``agent`` final turn succeeded
    outcomes: dict[str, int] = field(default_factory=dict)  # label (OUTCOMES, NO_ROWS) -> episodes

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else float("nan")

    def text(self) -> str:
        """``6 tasks x 4 samples = 24 episodes (3 solved, 5 failed, 16 ended at max turns); 5 ended before
        guesser's turn, counted as failures`` -- what a summary line says about its denominator."""
        ways = ", ".join(
            f"{n} {LABELS.get(k, 'left no rows' if k == NO_ROWS else k)}" for k, n in self.outcomes.items() if n
        )
        out = f"{self.tasks} tasks x {self.samples_per_task} samples = {self.episodes} episodes ({ways or 'none ran'})"
        if self.ended_before_agent:
            out += f"; {self.ended_before_agent} ended before {self.agent}'s turn, counted as failures"
        return out


def count_episodes(rows: Sequence[Mapping[str, Any]], agent: str, tasks: int, samples_per_task: int) -> EpisodeCounts:
    """How the asked episodes ended and how many the ``agent`` acted in (``EpisodeCounts``)."""
    episodes = episodes_of(rows, asked_episodes(tasks, samples_per_task))
    how: dict[Episode, str] = {}
    for row in rows:
        how[(int(row["env_idx"]), int(row["sample_idx"]))] = row_outcome(row)
    last = last_turns(rows)
    acted = [e for e in episodes if (agent, *e) in last]
    successes = sum(bool(last[(agent, *e)]["success"]) for e in acted)
    counted = Counter(how.get(e, NO_ROWS) for e in episodes)
    return EpisodeCounts(
        tasks=tasks,
        samples_per_task=samples_per_task,
        episodes=len(episodes),
        agent=agent,
        agent_acted=len(acted),
        ended_before_agent=len(episodes) - len(acted),
        successes=successes,
        outcomes={k: counted[k] for k in (*OUTCOMES, NO_ROWS) if counted[k]},
    )


def step_request(metadata: Mapping[str, Any], config: Any, step_name: str) -> tuple[int, int] | None:
    """(tasks, samples per task) a committed step asked for, from its manifest metadata (``tasks``,
    ``samples_per_task``); steps stored before ``samples_per_task``: the config's (validation and baseline:
    ``validation.samples_per_task``; rollouts: ``env.group_size``, 1 in tree mode). None: the step does not
    say which tasks it ran (the rows' episodes are then all that is known)."""
    tasks = metadata.get("tasks")
    if not isinstance(tasks, list):
        return None
    samples = metadata.get("samples_per_task")
    if samples is None:
        if step_name in (StepName.VALIDATION, StepName.BASELINE):
            samples = config.validation.samples_per_task
        else:
            samples = 1 if config.rollout.mode == "tree" else config.env.group_size
    return len(tasks), int(samples)
