"""What happened in a training run, in a dozen lines: ``make run`` ends with it, and so does the run's last
Prefect artifact (the ``train`` flow writes it as ``summary.md`` beside ``run.json``).

Per iteration: the training reward of each agent, and whether there was anything to learn from (a batch
without a non-zero advantage changes nothing: ``rl.signal``). Then the held-out success of the agent that
decides the outcome, before the first update (``iter-0/baseline``) and after the last (the last committed
``validation``), paired task by task with a 95 % interval over tasks (``analysis.stats.paired_bootstrap``),
the tokens generated and the wall time per phase. The verdict says plainly when the interval includes 0:
a short run cannot tell then, and the summary must not pretend otherwise.

``summarize_run`` reads a stored run; ``summary_lines`` and ``summary_markdown`` only format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pettingflow.steps.report import REPORT_STEP, history, stored_warnings
from pettingflow.storage import RunLayout, read_step_trajectories
from pettingflow.storage.layout import UPDATE_STEP_PREFIX, StepName

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
    rewards: dict[str, float]  # agent -> training reward mean
    success: dict[str, float]  # agent -> training success rate
    tokens: int
    rows_trained: int
    zero_signal: list[str] = field(default_factory=list)  # policies with nothing to learn from


@dataclass
class HeldOut:
    agent: str
    before: float
    after: float
    after_iteration: int
    delta: float
    ci95: tuple[float, float]
    tasks: int
    episodes: int  # per evaluation


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
        lines.append(
            IterationLine(
                k,
                rewards,
                success,
                int(report.get(f"{rollouts}/tokens_generated", 0)),
                int(report.get(f"{StepName.FILTERED}/rows_kept", 0)),
                zero,
            )
        )
        warnings += [f"iteration {k}: {w}" for w in stored_warnings(layout.step(k, REPORT_STEP))]
        timed = 0.0
        for key, seconds in report.items():
            if not key.startswith("duration/") or key == "duration/iteration_before_report_s":
                continue
            name = key.removeprefix("duration/").removesuffix("_s")
            phase = str(StepName.UPDATE) if name.startswith(UPDATE_STEP_PREFIX) else _PHASES.get(name, "other")
            phases[phase] += float(seconds)
            timed += float(seconds)
        total = float(report.get("duration/iteration_before_report_s", timed))
        phases["other"] += max(total - timed, 0.0)
        wall += total
    heldout, missing = _heldout(layout, [line.iteration for line in lines])
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


def _heldout(layout: RunLayout, iterations: list[int]) -> tuple[HeldOut | None, str | None]:
    """The outcome agent's held-out success before the first update and after the last validated one."""
    from pettingflow.analysis.learning import final_successes, outcome_agent
    from pettingflow.analysis.stats import paired_bootstrap
    from pettingflow.configs.loader import validate_config

    baseline = layout.step(0, StepName.BASELINE)
    if not baseline.is_committed():
        return None, "no baseline (validation.at_start is off, or validation.frequency is 0)"
    validated = [k for k in iterations if layout.step(k, StepName.VALIDATION).is_committed()]
    if not validated:
        return None, "no validation after an update yet"
    last = validated[-1]
    agent = outcome_agent(validate_config(layout.read_run_info()["config"], source=f"{layout.run_uri}/run.json"))
    columns = ["env_idx", "sample_idx", "turn_idx", "agent_name", "success"]
    before = final_successes(read_step_trajectories(baseline).select(columns).to_pylist(), agent)
    after = final_successes(
        read_step_trajectories(layout.step(last, StepName.VALIDATION)).select(columns).to_pylist(), agent
    )
    if not before or not after:
        return None, f"the held-out episodes have no turn of {agent!r}"
    paired = paired_bootstrap(before, after)
    return (
        HeldOut(
            agent,
            _rate(before),
            _rate(after),
            last,
            paired["delta"],
            (paired["ci95_low"], paired["ci95_high"]),
            int(paired["tasks"]),
            sum(map(len, after.values())),
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
    out.append("  training reward per iteration (each agent's last turn per episode: mean, success rate):")
    for line in summary.iterations:
        agents = "  ".join(
            f"{a} {r:.3f} ({line.success.get(a, float('nan')):.0%})" for a, r in sorted(line.rewards.items())
        )
        flag = f"  NO LEARNING SIGNAL ({', '.join(line.zero_signal)})" if line.zero_signal else ""
        out.append(f"    iter {line.iteration}: {agents}  rows trained {line.rows_trained}{flag}")
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
