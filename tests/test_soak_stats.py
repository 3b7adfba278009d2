"""bench/soak_stats.py: the slopes and verdicts of the soak's report."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from bench.soak_stats import Fit, after_warmup, against_goal, fit, later_half, report, t95


def test_a_planted_slope_is_found_with_an_interval_that_holds_it() -> None:
    rng = random.Random(0)
    xs = list(range(200))
    ys = [1000 + 0.3 * x + rng.gauss(0, 5) for x in xs]  # 30 MB per 100 iterations on 1000
    f = fit(xs, ys)
    assert f is not None
    assert abs(f.slope - 30) <= f.half_ci < 10
    assert f.pct == pytest.approx(100 * f.slope / f.level)


def test_segments_get_their_own_level_and_share_the_slope() -> None:
    """A restart drops memory back: fitted as one line the drop hides the growth, per segment it is found."""
    xs = list(range(100)) + list(range(100, 200))
    ys = [500 + 0.5 * x for x in range(100)] + [200 + 0.5 * x for x in range(100, 200)]
    groups = ["a"] * 100 + ["b"] * 100
    assert fit(xs, ys, groups).slope == pytest.approx(50)
    assert fit(xs, ys).slope < 0  # the pooled line would call a leak a shrink


def test_flat_noise_has_an_interval_holding_zero() -> None:
    rng = random.Random(1)
    xs = list(range(150))
    f = fit(xs, [60 + rng.gauss(0, 8) for _ in xs])
    assert f is not None and abs(f.slope) <= f.half_ci


def test_too_few_points_give_no_fit_and_t_approaches_the_normal() -> None:
    assert fit([1, 2], [3, 4]) is None
    assert fit([5, 5, 5], [1, 2, 3]) is None
    assert t95(10) == pytest.approx(2.228, abs=0.01) and t95(1000) == pytest.approx(1.962, abs=0.002)


def test_warmup_is_left_out_per_segment() -> None:
    samples = [{"iteration": k, "segment": "a" if k < 20 else "b"} for k in range(40)]
    assert [s["iteration"] for s in after_warmup(samples, 5)] == [*range(5, 20), *range(25, 40)]


def test_the_report_fails_a_leak_and_passes_a_flat_run() -> None:
    def samples(leak_mb: float) -> list[dict]:
        rng = random.Random(2)
        return [
            {"iteration": k, "segment": "s", "wall_s": 60 + rng.gauss(0, 3), "rss_mb/total": 5000 + leak_mb * k,
             "rss_mb/vllm": 3000.0, "disk_mb/checkpoints": 6500 + rng.gauss(0, 50), "disk_mb/other": 2.0 * k}
            for k in range(120)
        ]  # fmt: skip

    meta = {"run_id": "r", "warmup": 10}
    flat = report(samples(0.0), meta, [])
    assert "memory          OK" in flat and "disk            OK" in flat and "iteration time  OK" in flat
    leaky = report(samples(2.0), meta, [])  # 200 MB per 100 iterations on 5 GB: 4 %
    assert "memory          FAILS" in leaky


def test_the_later_half_tells_a_filling_cache_from_a_leak() -> None:
    """Memory that rises over a process's first 60 iterations and then stays fails the whole window's goal and
    passes the later half's; a leak of the same early rate fails both."""

    def samples(grow: Callable[[int], float]) -> list[dict]:
        rng = random.Random(3)
        return [
            {"iteration": k, "segment": "s", "wall_s": 30.0, "rss_mb/total": 2000 + grow(k) + rng.gauss(0, 5)}
            for k in range(200)
        ]

    meta = {"run_id": "r", "warmup": 10}
    filling = report(samples(lambda k: 4.0 * min(k, 60)), meta, [])  # +240 MB, then flat
    assert "memory          FAILS" in filling and "memory, later   OK" in filling
    leak = report(samples(lambda k: 4.0 * k), meta, [])
    assert "memory          FAILS" in leak and "memory, later   FAILS" in leak
    halves = later_half([{"iteration": k, "segment": "a" if k < 10 else "b"} for k in range(30)])
    assert [s["iteration"] for s in halves] == [*range(5, 10), *range(20, 30)]


def test_a_few_samples_decide_nothing() -> None:
    samples = [
        {"iteration": k, "segment": "s", "wall_s": 60.0 + 30 * k, "rss_mb/total": 5000.0 + 400 * k,
         "disk_mb/checkpoints": 1000.0 * k}
        for k in range(25)
    ]  # fmt: skip
    text = report(samples, {"run_id": "r", "warmup": 10}, [])
    assert "FAILS" not in text and text.count("undecided: 15 samples after the warm-up, 20 needed") == 3


def test_a_verdict_needs_the_whole_interval_on_one_side_of_the_goal() -> None:
    """1 % +- 0.5 % passes a 2 % goal, 3 % +- 0.5 % fails it, 1.8 % +- 0.5 % decides nothing: its point estimate is
    under the goal but the interval reaches past it."""
    assert against_goal(Fit(slope=10, half_ci=5, level=1000, n=50), 2.0)[0] is True
    assert against_goal(Fit(slope=30, half_ci=5, level=1000, n=50), 2.0)[0] is False
    ok, why = against_goal(Fit(slope=18, half_ci=5, level=1000, n=50), 2.0)
    assert ok is None and why.startswith("undecided") and "1.30..2.30 %" in why
    assert against_goal(Fit(slope=0, half_ci=1, level=1000, n=5), 2.0) == (
        None,
        "undecided: 5 samples after the warm-up, 20 needed",
    )
