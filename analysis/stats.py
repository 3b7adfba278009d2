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


def _task_bootstrap(diffs: Any, n_boot: int, seed: int) -> tuple[float, float]:
    """95 % interval of the mean of per-task differences, resampling tasks with replacement."""
    import numpy as np

    rng = np.random.default_rng(seed)
    boots = diffs[rng.integers(0, len(diffs), size=(n_boot, len(diffs)))].mean(axis=1)
    low, high = np.percentile(boots, [2.5, 97.5])
    return float(low), float(high)


def paired_arm_difference(
    a: Sequence[tuple[Mapping[int, Sequence[bool]], Mapping[int, Sequence[bool]]]],
    b: Sequence[tuple[Mapping[int, Sequence[bool]], Mapping[int, Sequence[bool]]]],
    n_boot: int = 5000,
    seed: int = 0,
) -> dict[str, Any]:
    """Arm A's held-out change minus arm B's, on the same tasks, with a 95 % interval over tasks.

    ``a[s]`` and ``b[s]`` are the (before, after) successes (task -> samples) of the two arms trained
    with the same seed ``s``. Per seed and task: ``(after_A - before_A) - (after_B - before_B)``; the
    seeds are averaged per task, and tasks are resampled (the task is the unit, as in ``paired_bootstrap``).
    Why the per-seed numbers too: with two or three seeds an interval over seeds means little, so the
    spread between training runs is shown as it is, next to the interval that covers tasks and sampling.
    """
    import numpy as np

    if len(a) != len(b) or not a:
        raise ValueError(f"need the same number (>= 1) of seeds per arm, got {len(a)} and {len(b)}")
    tasks = sorted(set.intersection(*(set(outcomes) for pair in (*a, *b) for outcomes in pair)))
    if not tasks:
        raise ValueError("the arms' evaluations share no held-out task; were they run on the same split?")

    def change(before: Mapping[int, Sequence[bool]], after: Mapping[int, Sequence[bool]]) -> np.ndarray:
        return np.array([np.mean(after[t]) - np.mean(before[t]) for t in tasks])

    per_seed = np.stack([change(*pa) - change(*pb) for pa, pb in zip(a, b, strict=True)])  # seeds x tasks
    diffs = per_seed.mean(axis=0)
    low, high = _task_bootstrap(diffs, n_boot, seed)
    return {
        "delta": float(diffs.mean()),
        "ci95_low": low,
        "ci95_high": high,
        "per_seed": [float(d) for d in per_seed.mean(axis=1)],
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
