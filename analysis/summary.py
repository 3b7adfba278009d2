"""What happened in a training run, in a dozen lines: ``make run`` ends with it, and so does the run's last
Prefect artifact (the ``train`` flow writes it as ``summary.md`` beside ``run.json``).

Per iteration: what each agent earned over every episode of the rollouts (its last turn's reward and success,
0 where the episode ended before its turn: ``analysis/outcomes.py``) and what its trained rows were credited
with (the training reward: turn reward plus the team's share, ``algorithm.team_reward_weight``, so a role
rewarded only through the team does not read as 0), how the episodes ended, and whether there was anything to
learn from (a batch without a non-zero advantage changes nothing: ``rl.signal``). Then the held-out success of
the agent that decides the outcome, before the first update (``iter-0/baseline``) and after the last (the last
committed ``validation``), over every episode asked for, paired task by task with a 95 % interval over tasks
(``analysis.stats.paired_bootstrap``), the tokens generated and the wall time per phase. The verdict says
plainly when the interval includes 0: a short run cannot tell then, and the summary must not pretend otherwise.

``summarize_run`` reads a stored run; ``summary_lines`` and ``summary_markdown`` only format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pettingflow.analysis.outcomes import EpisodeCounts
from pettingflow.steps.report import REPORT_STEP, history, stored_warnings
from pettingflow.storage import RunLayout, read_step_trajectories
from pettingflow.storage.layout import StepName, update_policy

# report duration keys -> the phase they count in
_PHASES = {
    StepName.ROLLOUTS: str(StepName.ROLLOUTS),
    StepName.FILTERED: "filter + advantages",
    StepName.ADVANTAGES: "filter + advantages",
    StepName.SYNC: "weight sync",
    StepName.BASELINE: str(StepName.VALIDATION),
    StepName.VALIDATION: str(StepName.VALIDATION),
}
PHASE_ORDER = (
    str(StepName.ROLLOUTS),
    "filter + advantages",
    str(StepName.UPDATE),
    "weight sync",
    str(StepName.VALIDATION),
    "other",
)


@dataclass
class IterationLine:
    iteration: int
    rewards: dict[str, float]  # agent -> its last turn's reward per episode, mean over every episode (0: no turn)
    success: dict[str, float]  # agent -> success rate over every episode of the rollouts
    tokens: int
    rows_trained: int
    zero_signal: list[str] = field(default_factory=list)  # policies with nothing to learn from
    # agent -> mean training reward of its rows in the advantage batches (turn reward + team credit)
    credited: dict[str, float] = field(default_factory=dict)
    episodes: EpisodeCounts | None = None  # what the rollouts asked for and how those episodes ended


@dataclass
class HeldOut:
    agent: str
    before: float
    after: float
    after_iteration: int
    delta: float
    ci95: tuple[float, float]
    tasks: int  # paired: asked for by both evaluations
    episodes: int  # per evaluation: asked for (tasks x samples per task)
    counts_before: EpisodeCounts | None = None
    counts_after: EpisodeCounts | None = None


@dataclass
class RunSummary:
    run_id: str
    iterations: list[IterationLine]
    heldout: HeldOut | None
    heldout_missing: str | None  # why there is no before -> after, when there is none
    tokens_generated: int
    phases_s: dict[str, float]
    wall_s: float
    warnings: list[str] = field(default_factory=list)


def summarize_run(layout: RunLayout) -> RunSummary:
    """Read the run's committed reports and its baseline and last validation; compute the paired change."""
    reports = history(layout)
    config = _run_config(layout)
    lines = []
    phases = dict.fromkeys(PHASE_ORDER, 0.0)
    wall = 0.0
    warnings: list[str] = []
    for report in reports:
        k = int(report["iteration"])
        rollouts = StepName.ROLLOUTS
        agents = sorted({key.split("/")[1] for key in report if key.startswith(f"{rollouts}/") and key.count("/") == 2})
        rewards = {a: report[key] for a in agents if (key := f"{rollouts}/{a}/reward_mean") in report}
        success = {a: report[key] for a in agents if (key := f"{rollouts}/{a}/success_rate") in report}
        zero = sorted(
            key.split("/")[1] for key, value in report.items() if key.endswith("/zero_signal") and value >= 1.0
        )
        line = IterationLine(
            k,
            rewards,
            success,
            int(report.get(f"{rollouts}/tokens_generated", 0)),
            int(report.get(f"{StepName.FILTERED}/rows_kept", 0)),
            zero,
            credited_rewards(layout, k),
        )
        _rescore(layout, k, config, line)
        lines.append(line)
        warnings += [f"iteration {k}: {w}" for w in stored_warnings(layout.step(k, REPORT_STEP))]
        timed = 0.0
        for key, seconds in report.items():
            if not key.startswith("duration/") or key == "duration/iteration_before_report_s":
                continue
            name = key.removeprefix("duration/").removesuffix("_s")
            phase = str(StepName.UPDATE) if update_policy(name) else _PHASES.get(name, "other")
            phases[phase] += float(seconds)
            timed += float(seconds)
        total = float(report.get("duration/iteration_before_report_s", timed))
        phases["other"] += max(total - timed, 0.0)
        wall += total
    heldout, missing = _heldout(layout, [line.iteration for line in lines], config)
    return RunSummary(
        layout.run_id,
        lines,
        heldout,
        missing,
        sum(line.tokens for line in lines),
        {k: round(v, 1) for k, v in phases.items()},
        round(wall, 1),
        warnings,
    )


# the columns the episode outcomes are computed from (analysis/outcomes.py)
OUTCOME_COLUMNS = [
    "env_name",
    "env_idx",
    "sample_idx",
    "turn_idx",
    "agent_name",
    "reward",
    "success",
    "done",
    "truncated",
    "continued",
    "outcome",
]


def _run_config(layout: RunLayout) -> Any | None:
    """The run's validated config (None for a run folder without one, e.g. hand-made reports in tests)."""
    from pettingflow.configs.loader import validate_stored_config

    try:
        info = layout.read_run_info()
    except FileNotFoundError:
        return None
    return validate_stored_config(info["config"], source=f"{layout.run_uri}/run.json")


def scored_step(
    layout: RunLayout, iteration: int, step_name: str, config: Any, agent: str | None
) -> tuple[dict[int, list[bool]], dict[str, dict[str, float]], EpisodeCounts] | None:
    """One committed step's episodes, every asked one counted: ``agent``'s success per task position, every
    agent's scores, and the counts. None: the step is not committed, or does not say what it asked for."""
    from pettingflow.analysis import outcomes

    step = layout.step(iteration, step_name)
    if not step.is_committed() or config is None:
        return None
    request = outcomes.step_request(step.manifest().metadata, config, step_name)
    if request is None:
        return None
    rows = read_step_trajectories(step, columns=OUTCOME_COLUMNS).to_pylist()
    asked = outcomes.asked_episodes(*request)
    agent = agent or outcome_agent_of(config)
    return (
        outcomes.episode_successes(rows, agent, asked),
        outcomes.agent_scores(rows, asked),
        outcomes.count_episodes(rows, agent, *request),
    )


def outcome_agent_of(config: Any) -> str:
    from pettingflow.analysis.learning import outcome_agent

    return outcome_agent(config)


def _rescore(layout: RunLayout, iteration: int, config: Any, line: IterationLine) -> None:
    """The iteration's training scores recomputed from its rollouts over every asked episode, so runs stored
    before that definition read the same as new ones; the report's numbers stay where that is not possible."""
    try:
        scored = scored_step(layout, iteration, StepName.ROLLOUTS, config, None)
    except ValueError:  # no agent decides the outcome: the report's per-agent numbers are all there is
        return
    if scored is None:
        return
    _, scores, counts = scored
    line.rewards = {a: v["reward_mean"] for a, v in scores.items()}
    line.success = {a: v["success_rate"] for a, v in scores.items()}
    line.episodes = counts


def credited_rewards(layout: RunLayout, iteration: int) -> dict[str, float]:
    """Agent -> mean training reward of its rows in the iteration's advantage batches: what its update was
    computed from (its turn reward mixed with the team reward, ``algorithm.team_reward_weight``, and
    ``gamma``). Empty where the advantages step is not committed or holds no training reward."""
    step = layout.step(iteration, StepName.ADVANTAGES)
    if not step.is_committed():
        return {}
    sums: dict[str, list[float]] = {}
    for name in step.files():
        if not (name.startswith("batch-") and name.endswith(".parquet")):
            continue
        table = step.read_table(name)
        if "training_reward" not in table.column_names:
            continue
        for agent, reward in zip(
            table.column("agent_name").to_pylist(), table.column("training_reward").to_pylist(), strict=True
        ):
            sums.setdefault(agent, []).append(float(reward))
    return {agent: sum(values) / len(values) for agent, values in sorted(sums.items()) if values}


def _heldout(layout: RunLayout, iterations: list[int], config: Any) -> tuple[HeldOut | None, str | None]:
    """The outcome agent's held-out success before the first update and after the last validated one, over
    every episode each evaluation asked for (one that ended before the agent's turn is a failure)."""
    from pettingflow.analysis.stats import paired_bootstrap

    baseline = layout.step(0, StepName.BASELINE)
    if not baseline.is_committed():
        return None, "no baseline (validation.at_start is off, or validation.frequency is 0)"
    validated = [k for k in iterations if layout.step(k, StepName.VALIDATION).is_committed()]
    if not validated:
        return None, "no validation after an update yet"
    last = validated[-1]
    agent = outcome_agent_of(config)
    scored_before = scored_step(layout, 0, StepName.BASELINE, config, agent)
    scored_after = scored_step(layout, last, StepName.VALIDATION, config, agent)
    if scored_before is None or scored_after is None:
        return None, "the held-out steps do not record which tasks they ran (stored before the manifest said so)"
    before, _, counts_before = scored_before
    after, _, counts_after = scored_after
    if not before or not after:
        return None, "the held-out evaluations asked for no episode"
    paired = paired_bootstrap(before, after)  # over the tasks both asked for: the same tasks on both sides
    return (
        HeldOut(
            agent,
            _rate(before),
            _rate(after),
            last,
            paired["delta"],
            (paired["ci95_low"], paired["ci95_high"]),
            int(paired["tasks"]),
            counts_after.episodes,
            counts_before,
            counts_after,
        ),
        None,
    )


def _rate(scored: dict[int, list[bool]]) -> float:
    """Success rate over every episode (task -> successes per sample)."""
    return sum(map(sum, scored.values())) / max(sum(map(len, scored.values())), 1)


def verdict(heldout: HeldOut) -> str:
    """One honest sentence on the held-out change."""
    low, high = heldout.ci95
    if low > 0:
        return "held-out success rose; the 95 % interval excludes 0"
    if high < 0:
        return "held-out success fell; the 95 % interval excludes 0"
    return (
        "the 95 % interval includes 0: a run this short cannot tell whether training changed held-out success "
        "(more iterations, or more held-out samples per task, narrow it)"
    )


def summary_lines(summary: RunSummary) -> list[str]:
    """The summary as plain text lines (what ``make run`` prints)."""
    out = [f"what happened in run {summary.run_id}:"]
    if not summary.iterations:
        return [*out, "  no iteration has a committed report yet"]
    out.append(
        "  training reward per iteration (each agent's last turn per episode, over every episode, 0 where it had "
        "no turn: mean, success rate; trained on: mean training reward of its rows, team credit included):"
    )
    for line in summary.iterations:
        agents = "  ".join(
            f"{a} {r:.3f} ({line.success.get(a, float('nan')):.0%})"
            + (f" trained on {line.credited[a]:.3f}" if a in line.credited else "")
            for a, r in sorted(line.rewards.items())
        )
        flag = f"  NO LEARNING SIGNAL ({', '.join(line.zero_signal)})" if line.zero_signal else ""
        out.append(f"    iter {line.iteration}: {agents}  rows trained {line.rows_trained}{flag}")
        if line.episodes is not None:
            out.append(f"      episodes: {line.episodes.text()}")
    held = summary.heldout
    if held is None:
        out.append(f"  held-out success: not measured ({summary.heldout_missing})")
    else:
        low, high = held.ci95
        out.append(
            f"  held-out success of {held.agent} ({held.tasks} tasks, {held.episodes} episodes): "
            f"{held.before:.1%} before -> {held.after:.1%} after iteration {held.after_iteration}, "
            f"change {100 * held.delta:+.1f} pts (95 % CI [{100 * low:+.1f}, {100 * high:+.1f}])"
        )
        out.append(f"    {verdict(held)}")
        for when, counts in (("before", held.counts_before), ("after", held.counts_after)):
            if counts is not None:
                out.append(f"    held-out episodes {when}: {counts.text()}")
    out.append(f"  tokens generated in training: {summary.tokens_generated:,}")
    phases = ", ".join(f"{name} {summary.phases_s[name]:.0f} s" for name in PHASE_ORDER if summary.phases_s.get(name))
    out.append(f"  wall time {summary.wall_s / 60:.1f} min over the iterations: {phases}")
    if any(line.zero_signal for line in summary.iterations):
        out.append("  warning: some iterations had no learning signal:")
        out += [f"    {w}" for w in summary.warnings]
    return out


def summary_markdown(summary: RunSummary) -> str:
    """The summary as a Prefect markdown artifact (and ``summary.md`` beside the run's ``run.json``)."""
    lines = summary_lines(summary)
    return f"# Run summary: {summary.run_id}\n\n```text\n" + "\n".join(lines[1:]) + "\n```\n"


def summary_json(summary: RunSummary) -> str:
    """Every number of the summary, for tools."""
    from dataclasses import asdict

    return json.dumps(asdict(summary), indent=2, default=_default)


def _default(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else str(value)
