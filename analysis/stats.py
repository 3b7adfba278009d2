"""The statistics of a learning report, as pure functions (no I/O): paired intervals and smoothed curves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def paired_bootstrap(
    before: Mapping[int, Sequence[bool]], after: Mapping[int, Sequence[bool]], n_boot: int = 5000, seed: int = 0
) -> dict[str, float]:
    """Change in success rate on the same held-out tasks, with a 95 % interval from resampling tasks.

    Why tasks and not episodes: samples of one task are correlated (an easy task is solved by most of
    its samples), so the task is the unit of independent evidence. Both evaluations use the same tasks
    and sampling seeds, so the difference is paired task by task.
    """
    import numpy as np

    tasks = sorted(set(before) & set(after))
    if not tasks:
        raise ValueError("the two evaluations share no held-out task; were they run on the same split?")
    diffs = np.array([np.mean(after[t]) - np.mean(before[t]) for t in tasks])
    low, high = _task_bootstrap(diffs, n_boot, seed)
    return {
        "delta": float(diffs.mean()),
        "ci95_low": low,
        "ci95_high": high,
        "tasks": float(len(tasks)),
        "tasks_better": float((diffs > 0).sum()),
        "tasks_worse": float((diffs < 0).sum()),
    }


def success_interval(successes: Mapping[int, Sequence[bool]], n_boot: int = 5000, seed: int = 0) -> dict[str, float]:
    """One evaluation's success rate with a 95 % interval from resampling tasks (task -> successes per sample).

    Why tasks, as in ``paired_bootstrap``: the samples of one task are correlated, so an interval over episodes
    would be too narrow. The rate is over every episode (tasks with equal samples weigh alike)."""
    import numpy as np

    if not successes or not any(successes.values()):
        raise ValueError("an evaluation with no episode has no success rate; did it ask for any task?")
    tasks = sorted(t for t, values in successes.items() if len(values))
    rates = np.array([np.mean(successes[t]) for t in tasks])
    episodes = sum(len(successes[t]) for t in tasks)
    low, high = _task_bootstrap(rates, n_boot, seed)
    return {
        "success_rate": sum(sum(successes[t]) for t in tasks) / episodes,
        "ci95_low": low,
        "ci95_high": high,
        "tasks": float(len(tasks)),
        "episodes": float(episodes),
    }


def _task_bootstrap(diffs: Any, n_boot: int, seed: int) -> tuple[float, float]:
    """95 % interval of the mean of per-task differences, resampling tasks with replacement."""
    import numpy as np

    rng = np.random.default_rng(seed)
    boots = diffs[rng.integers(0, len(diffs), size=(n_boot, len(diffs)))].mean(axis=1)
    low, high = np.percentile(boots, [2.5, 97.5])
    return float(low), float(high)


#: Student-t quantiles by degrees of freedom (standard tables), for intervals and power over a few seeds, where the
#: normal approximation is far off (df 2: 4.30 vs 1.96). Between listed df the smaller df is used (conservative).
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}  # fmt: skip
T_80 = {1: 1.376, 2: 1.061, 3: 0.978, 4: 0.941, 5: 0.920, 6: 0.906, 7: 0.896, 8: 0.889, 9: 0.883, 10: 0.879,
        12: 0.873, 15: 0.866, 20: 0.860, 30: 0.854}  # fmt: skip
Z_975, Z_80 = 1.960, 0.842


def t_quantile(table: Mapping[int, float], df: int, normal: float) -> float:
    """The quantile for ``df`` degrees of freedom from ``table`` (the nearest listed df below; ``normal`` past 30)."""
    if df < 1:
        raise ValueError(f"a t quantile needs at least 1 degree of freedom, got {df}")
    if df > max(table):
        return normal
    return table[max(k for k in table if k <= df)]


def detectable_effect(sd: float, n: int) -> float:
    """The smallest true mean difference that ``n`` paired units with spread ``sd`` detect with 80 % power at a
    two-sided 5 % level: ``(t_.975 + t_.80) * sd / sqrt(n)`` with ``n - 1`` degrees of freedom."""
    if n < 2:
        raise ValueError(f"a detectable effect needs at least 2 units to estimate their spread, got {n}")
    df = n - 1
    return (t_quantile(T_975, df, Z_975) + t_quantile(T_80, df, Z_80)) * sd / n**0.5


def units_needed(sd: float, effect: float, most: int = 1000) -> int:
    """How many paired units (seeds) it takes for ``detectable_effect`` to reach ``effect``; ``most`` if none do."""
    if effect <= 0:
        raise ValueError(f"the effect to detect must be positive, got {effect}")
    return next((n for n in range(2, most + 1) if detectable_effect(sd, n) <= effect), most)


def paired_arm_difference(
    a: Sequence[tuple[Mapping[int, Sequence[bool]], Mapping[int, Sequence[bool]]]],
    b: Sequence[tuple[Mapping[int, Sequence[bool]], Mapping[int, Sequence[bool]]]] | None = None,
    n_boot: int = 5000,
    seed: int = 0,
) -> dict[str, Any]:
    """Arm A's held-out change minus arm B's, on the same tasks, with a 95 % interval over tasks.

    ``a[s]`` and ``b[s]`` are the (before, after) successes (task -> samples) of the two arms trained
    with the same seed ``s``. Per seed and task: ``(after_A - before_A) - (after_B - before_B)``; the
    seeds are averaged per task, and tasks are resampled (the task is the unit, as in ``paired_bootstrap``).
    Why the per-seed numbers too: with two or three seeds an interval over seeds is wide, so the spread between
    training runs is shown as it is, next to the interval that covers tasks and sampling. ``ci95_seeds`` is the
    t-interval over the seeds' differences (the training run as the unit), and ``detectable_seeds`` /
    ``detectable_tasks`` the smallest effect the design detects with 80 % power over seeds / over tasks; both
    over-seed numbers are None when there is one seed or the seeds agree exactly (``seed_sd`` 0: no spread seen).
    Without ``b``, A's change alone, with the same intervals: e.g. the trained team's score with its roles swapped
    minus its score as trained (``a[s] = (as trained, swapped)``), the positive control of a study.
    """
    import numpy as np

    if (b is not None and len(a) != len(b)) or not a:
        raise ValueError(f"need the same number (>= 1) of seeds per arm, got {len(a)} and {len(b or [])}")
    tasks = sorted(set.intersection(*(set(outcomes) for pair in (*a, *(b or [])) for outcomes in pair)))
    if not tasks:
        raise ValueError("the arms' evaluations share no held-out task; were they run on the same split?")

    def change(before: Mapping[int, Sequence[bool]], after: Mapping[int, Sequence[bool]]) -> np.ndarray:
        return np.array([np.mean(after[t]) - np.mean(before[t]) for t in tasks])

    if b is None:
        per_seed = np.stack([change(*pa) for pa in a])  # seeds x tasks
    else:
        per_seed = np.stack([change(*pa) - change(*pb) for pa, pb in zip(a, b, strict=True)])
    diffs = per_seed.mean(axis=0)
    low, high = _task_bootstrap(diffs, n_boot, seed)
    seed_means = per_seed.mean(axis=1)
    over_seeds: dict[str, Any] = {"ci95_seeds": None, "detectable_seeds": None, "seed_sd": None}
    sd = float(seed_means.std(ddof=1)) if len(seed_means) >= 2 else None  # training-run variance: seed = unit
    if sd is not None and sd < 1e-12:
        # Seeds that agree exactly (scores move in steps of 1/samples) give no estimate of the spread between
        # training runs: a zero-width interval and a detectable effect of 0 would read as certainty.
        over_seeds["seed_sd"] = 0.0
    elif sd is not None:
        half = t_quantile(T_975, len(seed_means) - 1, Z_975) * sd / len(seed_means) ** 0.5
        over_seeds = {
            "ci95_seeds": [float(seed_means.mean() - half), float(seed_means.mean() + half)],
            "detectable_seeds": detectable_effect(sd, len(seed_means)),
            "seed_sd": sd,
        }
    return {
        "delta": float(diffs.mean()),
        "ci95_low": low,
        "ci95_high": high,
        **over_seeds,
        "detectable_tasks": detectable_effect(float(diffs.std(ddof=1)), len(diffs)) if len(diffs) >= 2 else None,
        "per_seed": [float(d) for d in seed_means],
        "tasks": len(tasks),
        "tasks_better": int((diffs > 0).sum()),
        "tasks_worse": int((diffs < 0).sum()),
    }


def smooth(values: Sequence[float], window: int = 4) -> list[float]:
    """Trailing moving average: the train reward of one iteration (8 tasks) is noisy."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def first_last_mean(values: Sequence[float], n: int = 4) -> tuple[float, float]:
    """Mean of the first and of the last ``n`` values (or of all of them when there are fewer)."""
    if not values:
        return float("nan"), float("nan")
    n = max(1, min(n, len(values) // 2 or 1))
    return sum(values[:n]) / n, sum(values[-n:]) / n
