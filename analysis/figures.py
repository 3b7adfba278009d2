"""The learning report as a person reads it: the markdown results table and the two-panel PNG."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pettingflow.analysis.stats import smooth
from pettingflow.steps.report import figure_png

if TYPE_CHECKING:
    from pettingflow.analysis.learning import ArmResult

#: The agent whose held-out success is the headline: the one that writes the code.
HEADLINE_AGENT = "code_generator"


def _revisit(row: Mapping[str, Any]) -> str:
    if row.get("revisit_first") is None:
        return "n/a (no task drawn twice)"
    low, high = row["revisit_ci95"]
    return (
        f"{100 * row['revisit_first']:.1f} % → {100 * row['revisit_last']:.1f} % "
        f"[{100 * low:+.1f}, {100 * high:+.1f}], {row['revisit_tasks']} tasks"
    )


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The results table as markdown (what ``docs/results.md`` quotes)."""

    def pct(v: Any) -> str:
        return "n/a" if v is None else f"{100 * v:.1f} %"

    def num(v: Any) -> str:
        return "n/a" if v is None else f"{v:.3f}"

    lines = [
        "| config | held-out pass@1, sampled: before | after | change (95 % CI over tasks) | greedy: before "
        "| after | roles swapped, after | train tasks drawn twice: first draw → last (95 % CI) "
        "| train reward, first 4 it. | last 4 it. | iterations | tokens generated in training (k) "
        "| wall time, evaluations included (min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        delta = "n/a" if r["heldout_delta"] is None else f"{100 * r['heldout_delta']:+.1f} pts"
        if r.get("heldout_ci95"):
            low, high = r["heldout_ci95"]
            delta += f" [{100 * low:+.1f}, {100 * high:+.1f}]"
        seed = "" if r.get("seed") is None else f" (seed {r['seed']})"
        wall = f"{r['wall_s'] / 60:.1f}" if r.get("wall_s") else "n/a"  # n/a: rebuilt from runs, not timed by learn
        lines.append(
            f"| `{r['config']}`{seed} | {pct(r['heldout_before'])} | {pct(r['heldout_after'])} | {delta} | "
            f"{pct(r['greedy_before'])} | {pct(r['greedy_after'])} | {pct(r.get('swapped_after'))} | {_revisit(r)} | "
            f"{num(r['train_reward_first4'])} | {num(r['train_reward_last4'])} | {r['iterations']} | "
            f"{r['tokens_generated'] / 1000:.1f} | {wall} |"
        )
    return "\n".join(lines)


def _pcts(values: Sequence[Any]) -> str:
    return ", ".join("n/a" if v is None else f"{100 * v:.1f}" for v in values)


def _interval(d: Mapping[str, Any]) -> str:
    """The interval over seeds, or why there is none (``stats.paired_arm_difference``)."""
    if values := d.get("ci95_seeds"):
        return f"[{100 * values[0]:+.1f}, {100 * values[1]:+.1f}]"
    return "n/a (seeds agree exactly)" if d.get("seed_sd") == 0.0 else "n/a (1 seed)"


def _pts(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} pts"


def _difference(d: Mapping[str, Any]) -> str:
    """The cells of a ``stats.paired_arm_difference``: mean [CI over tasks] | per seed | CI over seeds | detectable."""
    return (
        f"{100 * d['delta']:+.1f} pts [{100 * d['ci95_low']:+.1f}, {100 * d['ci95_high']:+.1f}] | "
        f"{', '.join(f'{100 * x:+.1f}' for x in d['per_seed'])} | {_interval(d)} | "
        f"{_pts(d.get('detectable_seeds'))}, {_pts(d.get('detectable_tasks'))}"
    )


def summary_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """Per config over its seeds (``learning.config_summaries``): mean scores, the change with its intervals,
    and the mean budget and cost of a run."""
    lines = [
        "| config, over seeds | seeds | held-out before (mean) | after (mean) | change (95 % CI over tasks) "
        "| per seed | 95 % CI over seeds | detectable (80 % power): seeds, tasks | tokens generated (k, mean) "
        "| iterations (mean) | wall time (min, mean) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in summaries:
        wall = "n/a" if c.get("wall_s") is None else f"{c['wall_s'] / 60:.1f}"
        lines.append(
            f"| `{c['config']}` | {', '.join(map(str, c['seeds']))} | {_pcts([c['before']])} | {_pcts([c['after']])} | "
            f"{_difference(c)} | {c['tokens_generated'] / 1000:.1f} | {c['iterations']:.1f} | {wall} |"
        )
    return "\n".join(lines)


def comparison_table(comparisons: Sequence[Mapping[str, Any]]) -> str:
    """Arm against arm (``learning.compare_arms``): each arm's held-out change per seed, the difference of
    the changes with its interval over tasks, and the tokens each arm generated in training."""
    lines = [
        "| A vs B | seeds | A held-out before → after (%, per seed) | B before → after | A change − B change "
        "(95 % CI over tasks) | per seed | 95 % CI over seeds | detectable (80 % power): seeds, tasks | "
        "tokens generated in training, A / B (k) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        tokens = ", ".join(
            f"{x / 1000:.1f} / {y / 1000:.1f}" for x, y in zip(c["a_tokens"], c["b_tokens"], strict=True)
        )
        lines.append(
            f"| `{c['a']}` vs `{c['b']}` | {', '.join(map(str, c['seeds']))} | "
            f"{_pcts(c['a_before'])} → {_pcts(c['a_after'])} | {_pcts(c['b_before'])} → {_pcts(c['b_after'])} | "
            f"{_difference(c)} | {tokens} |"
        )
    return "\n".join(lines)


def role_swap_table(effects: Sequence[Mapping[str, Any]]) -> str:
    """The positive control (``learning.role_swap_effects``): held-out success after training as trained and with
    the roles swapped, per seed, and the swap's effect with its intervals over tasks and over seeds."""
    lines = [
        "| roles swapped (positive control) | seeds | held-out after, as trained (%, per seed) | roles swapped | "
        "swapped − as trained (95 % CI over tasks) | per seed | 95 % CI over seeds | "
        "detectable (80 % power): seeds, tasks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in effects:
        lines.append(
            f"| `{e['config']}` | {', '.join(map(str, e['seeds']))} | {_pcts(e['trained'])} | {_pcts(e['swapped'])} | "
            f"{_difference(e)} |"
        )
    return "\n".join(lines)


def learning_png(arms: Sequence[ArmResult]) -> bytes:
    """Left: train reward per iteration (raw and 4-iteration mean). Right: held-out success of each arm's
    outcome agent (sampled view), from the base model (x = -1) through any periodic validations to the final
    evaluation (x = last iteration)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, arm in enumerate(arms):
        color = f"C{i}"
        label = arm.config if arm.seed is None else f"{arm.config} s{arm.seed}"
        pts = [p for p in arm.curve if "train_reward" in p]
        xs = [p["iteration"] for p in pts]
        ys = [p["train_reward"] for p in pts]
        if xs:
            left.plot(xs, ys, color=color, alpha=0.35, marker=".", linestyle="-")
            left.plot(xs, smooth(ys), color=color, linewidth=2, label=f"{label} (4-it. mean)")
        held = [(-1.0, arm.headline("before"))]
        held += [(p["iteration"], p["heldout_success"]) for p in arm.curve if "heldout_success" in p]
        last = max((p["iteration"] for p in arm.curve), default=0.0)
        if not any(x == last for x, _ in held[1:]):
            held.append((last, arm.headline("after")))
        held = [(x, y) for x, y in held if y is not None]
        if held:
            hx, hy = zip(*held, strict=True)
            right.plot(hx, hy, color=color, marker="o", label=label)
    who = " / ".join(sorted({arm.headline_agent for arm in arms})) or HEADLINE_AGENT
    left.set_title(f"{who}: train reward per iteration", fontsize=10)
    right.set_title(f"{who}: held-out success, sampled (x=-1: base model)", fontsize=10)
    for ax in (left, right):
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return figure_png(fig)
