"""The soak's numbers: slopes per 100 iterations after a warm-up, verdicts against a long run's goals, the table and
the plot (``python -m bench.soak --report [--publish DIR]``).

Slopes are least squares over the iteration number. Process figures (memory, descriptors, threads) and the time per
iteration are fitted *within segments*, a segment being the life of one flow-run process (a resume or a kill starts
a new one: the processes restart and their memory with them), with an intercept per segment and one common slope;
the first ``warmup`` samples of every segment are left out (model loads, caches and the allocator settle there).
Disk figures persist across segments and are fitted over every sample after the first ``warmup`` iterations.

Verdicts (docs/benchmarks.md, "bench/soak.py"), each decided on at least 20 samples after the warm-up and by the
slope's whole 95 % interval (``against_goal``): OK when all of it is within the goal, FAILS when all of it is beyond,
undecided when it holds the goal (a point estimate under the goal with an interval reaching past it is not a pass):

- memory (resident, each role and the total): the slope is at most 2 % of the post-warm-up level (the median) per
  100 iterations. It is decided twice: over everything after the warm-up, and over the later half of each
  segment's samples (``later_half``). A bounded cache that fills over the first tens of iterations of a process's
  life (a cache of bounded size, such as oneDNN's primitive cache, or the allocator's arenas) fails the first and
  passes the second; a leak fails both. A run of hundreds of iterations lives in the second;
- disk: the checkpoints' bytes (update and optimizer steps, what the ``disk`` settings bound) are flat, i.e. the
  slope is at most 2 % of their level per 100 iterations; the rest of the run folder (trajectories, reports,
  markers) and the Prefect database grow with the run by design and are reported as MB per 100 iterations;
- iteration time: flat when the slope's 95 % interval includes 0, or the slope is under 5 % of the median per 100
  iterations. The machine is shared: the load average of each sample is in the table and the plot, and the interval
  assumes independent residuals (consecutive iterations on a loaded machine are correlated, so it is too narrow
  rather than too wide).
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MEMORY_GOAL_PCT = 2.0
DISK_GOAL_PCT = 2.0
TIME_GOAL_PCT = 5.0
#: fewer samples after the warm-up than this decide nothing (the slope of a few iterations is the machine's noise)
MIN_VERDICT_SAMPLES = 20
ROLES = ("prefect_server", "worker", "flow", "vllm", "learner", "ray_workers", "ray_system", "other")


@dataclass
class Fit:
    slope: float  # per 100 iterations
    half_ci: float  # half width of the 95 % interval, per 100 iterations (inf with too few points)
    level: float  # median of the values fitted
    n: int

    @property
    def pct(self) -> float:
        return 100 * self.slope / self.level if self.level else math.nan


def decided(f: Fit | None) -> bool:
    return f is not None and f.n >= MIN_VERDICT_SAMPLES


def undecided(f: Fit | None) -> str:
    return f"undecided: {f.n if f else 0} samples after the warm-up, {MIN_VERDICT_SAMPLES} needed"


def against_goal(f: Fit | None, goal_pct: float) -> tuple[bool | None, str]:
    """A slope's verdict against a goal (a growth of at most ``goal_pct`` % of the level per 100 iterations),
    decided by the whole 95 % interval, not the point estimate: OK when its upper end is within the goal, FAILS
    when its lower end is beyond it, undecided when it holds the goal (more iterations narrow it)."""
    if not decided(f):
        return None, undecided(f)
    assert f is not None
    lo, hi = (100 * (f.slope - f.half_ci) / f.level, 100 * (f.slope + f.half_ci) / f.level) if f.level else (0, 0)
    why = f"{fmt(f.pct, 2)} % per 100 iterations (95 % CI {fmt(lo, 2)}..{fmt(hi, 2)} %)"
    if hi <= goal_pct:
        return True, why
    if lo > goal_pct:
        return False, why
    return None, f"undecided: {why} holds the goal of {goal_pct:g} %"


def t95(df: int) -> float:
    """Two-sided 95 % quantile of Student's t (Cornish-Fisher expansion around the normal's 1.96; within 1 % for
    df >= 3, which is all the soak uses it for)."""
    if df < 1:
        return math.inf
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def fit(xs: Sequence[float], ys: Sequence[float], groups: Sequence[str] | None = None) -> Fit | None:
    """Least-squares slope of ``ys`` over ``xs`` with one intercept per group (None: one group), per 100 iterations,
    with its 95 % interval; None with fewer than 3 points or no spread in ``xs``."""
    groups = list(groups) if groups is not None else ["all"] * len(xs)
    if len(xs) < 3:
        return None
    by: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        by.setdefault(g, []).append(i)
    dx, dy = [0.0] * len(xs), [0.0] * len(xs)
    for idx in by.values():
        mx = sum(xs[i] for i in idx) / len(idx)
        my = sum(ys[i] for i in idx) / len(idx)
        for i in idx:
            dx[i], dy[i] = xs[i] - mx, ys[i] - my
    sxx = sum(v * v for v in dx)
    if sxx == 0:
        return None
    b = sum(a * c for a, c in zip(dx, dy, strict=True)) / sxx
    df = len(xs) - len(by) - 1
    resid = sum((c - b * a) ** 2 for a, c in zip(dx, dy, strict=True))
    se = math.sqrt(resid / df / sxx) if df > 0 else math.inf
    return Fit(100 * b, 100 * t95(df) * se, statistics.median(ys), len(xs))


def after_warmup(samples: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """The samples after the first ``warmup`` of each segment (in iteration order)."""
    seen: dict[str, int] = {}
    kept = []
    for s in sorted(samples, key=lambda s: s["iteration"]):
        seg = s.get("segment", "")
        seen[seg] = seen.get(seg, 0) + 1
        if seen[seg] > warmup:
            kept.append(s)
    return kept


def later_half(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The later half of each segment's samples (in iteration order): what is left once a cache that fills during
    a process's first iterations has filled, while a leak still grows there at the same rate."""
    by: dict[str, list[dict[str, Any]]] = {}
    for s in sorted(samples, key=lambda s: s["iteration"]):
        by.setdefault(s.get("segment", ""), []).append(s)
    return sorted((s for rows in by.values() for s in rows[len(rows) // 2 :]), key=lambda s: s["iteration"])


def series(samples: list[dict[str, Any]], metric: str) -> tuple[list[float], list[float], list[str]]:
    rows = [s for s in samples if isinstance(s.get(metric), int | float)]
    return [float(s["iteration"]) for s in rows], [float(s[metric]) for s in rows], [s.get("segment", "") for s in rows]


def fmt(v: float, digits: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.{digits}f}"


def report(samples: list[dict[str, Any]], meta: dict[str, Any], kills: list[dict[str, Any]]) -> str:
    """The printout: what was sampled, each metric's level and slope per 100 iterations, and the verdicts."""
    warmup = int(meta.get("warmup", 10))
    if not samples:
        return "no samples yet"
    its = sorted(s["iteration"] for s in samples)
    segments = sorted({s.get("segment", "") for s in samples})
    # process figures only where the flow run's process was there (a sample taken just after a kill has a part)
    live = [s for s in samples if not s.get("late") and s.get("procs/flow", 1) > 0]
    loads = [s["load1"] for s in samples if "load1" in s]
    lines = [
        f"soak {meta['run_id']}: {len(samples)} iterations sampled ({its[0]}..{its[-1]}), {len(segments)} segment(s) "
        f"(flow-run processes), warm-up {warmup} per segment left out; {len(kills)} kill(s)"
        + (f"; only iterations from {meta['since']} on (--since)" if meta.get("since") else ""),
        f"  load average (1 min) per sample: median {fmt(statistics.median(loads))}, "
        f"range {fmt(min(loads))}..{fmt(max(loads))} (the machine's other jobs included)"
        if loads
        else "",
    ]
    if live:
        first, last = min(live, key=lambda s: s["iteration"]), max(live, key=lambda s: s["iteration"])
        keys = [f"rss_mb/{r}" for r in (*ROLES, "total")] + ["pss_mb/total", "fds/total", "threads/total"]
        keys = [k for k in keys if first.get(k) or last.get(k)]
        lines.append(
            f"  first and last sample with the run's processes (iterations {first['iteration']}, {last['iteration']}):"
        )
        lines += [f"    {k:<22} {fmt(first.get(k, math.nan)):>10} -> {fmt(last.get(k, math.nan)):>10}" for k in keys]
    walls = [s["wall_s"] for s in samples if s.get("wall_s")]
    if walls:
        lines.append(f"  time per iteration: median {fmt(statistics.median(walls))} s over {len(walls)} iterations")
    post = after_warmup(live, warmup)
    verdicts: list[tuple[str, bool | None, str]] = []

    def row(name: str, f: Fit | None, unit: str, goal: str = "", ok: bool | None = None) -> str:
        if f is None:
            return f"  {name:<34} {'(too few samples)':>12}"
        mark = "" if ok is None else ("OK" if ok else "FAILS")
        return (
            f"  {name:<34} {fmt(f.level):>10} {unit:<3} {fmt(f.slope, 2):>10} ± {fmt(f.half_ci, 2):<9} "
            f"{fmt(f.pct, 2):>8} %  {goal:<14} {mark}"
        )

    header = f"  {'metric':<34} {'level':>10} {'':<3} {'slope/100':>10}   {'95% CI':<9} {'of level':>10}  goal"
    lines += ["", f"memory and processes (within segments, {len(post)} samples after warm-up)", header]
    memory = (
        ("rss_mb", "MB", MEMORY_GOAL_PCT),
        ("pss_mb", "MB", MEMORY_GOAL_PCT),
        ("fds", "", None),
        ("threads", "", None),
    )

    def per_role(
        rows: list[dict[str, Any]], key: str, unit: str, goal: float | None, verdict: str, where: str = ""
    ) -> None:
        """A row per role and the total of ``key`` fitted on ``rows``; with a goal, the total's verdict and every
        role's failure under ``verdict``."""
        for role in (*ROLES, "total"):
            metric = f"{key}/{role}"
            xs, ys, gs = series(rows, metric)
            if not ys or max(ys) == 0:
                continue
            f = fit(xs, ys, gs)
            ok, why = against_goal(f, goal) if goal is not None else (None, "")
            lines.append(row(metric, f, unit, f"<= {goal:g} %" if goal else "", ok))
            if goal and role == "total" and key == "rss_mb":
                verdicts.append((verdict, ok, f"total resident memory{where}: {why}"))
            elif goal and ok is False:
                verdicts.append((verdict, ok, f"{metric}{where}: {why}"))

    for key, unit, goal in memory:
        per_role(post, key, unit, goal, "memory")
    if not any(v[0] == "memory" for v in verdicts):
        verdicts.append(("memory", None, undecided(None)))
    late = later_half(post)
    lines += ["", f"resident memory, the later half of each segment ({len(late)} samples): does it level off?", header]
    per_role(late, "rss_mb", "MB", MEMORY_GOAL_PCT, "memory, later", " in the later half")
    for metric in sorted({k for s in post for k in s if k.startswith("rss_mb/vllm/")}):  # vLLM's processes apart
        xs, ys, gs = series(post, metric)
        lines.append(row(metric, fit(xs, ys, gs), "MB"))
    xs, ys, gs = series(post, "procs/total")
    if ys:
        lines.append(row("procs/total", fit(xs, ys, gs), ""))

    disk = [s for s in samples if s["iteration"] >= its[0] + warmup]
    lines += ["", f"disk (all segments, {len(disk)} samples after the first {warmup} iterations)", header]
    for metric in ("disk_mb/checkpoints", "disk_mb/other", "disk_mb/run", "disk_mb/prefect_db", "disk_mb/logs"):
        xs, ys, _ = series(disk, metric)
        if not ys:
            continue
        f = fit(xs, ys)
        if metric == "disk_mb/checkpoints":
            ok, why = against_goal(f, DISK_GOAL_PCT)
            lines.append(row(metric, f, "MB", f"<= {DISK_GOAL_PCT:g} %", ok))
            lo, hi = min(ys), max(ys)
            verdicts.append(("disk", ok, f"checkpoints: {why} (range {lo:,.0f}..{hi:,.0f} MB)"))
        else:
            lines.append(row(metric, f, "MB", "grows by design" if metric != "disk_mb/run" else ""))
    xs, ys, _ = series(disk, "disk_mb/other")
    f = fit(xs, ys)
    if f is not None:
        lines.append(f"  the rest of the run folder (trajectories, reports): {fmt(f.slope)} MB per 100 iterations")
    xs, ys, _ = series(disk, "disk_mb/prefect_db")
    f = fit(xs, ys)
    if f is not None:
        lines.append(f"  the Prefect database: {fmt(f.slope)} MB per 100 iterations")

    lines += ["", "time per iteration (within segments; seconds)", header]
    xs, ys, gs = series(post, "wall_s")
    f = fit(xs, ys, gs)
    ok = (abs(f.slope) <= f.half_ci or f.pct <= TIME_GOAL_PCT) if decided(f) else None
    lines.append(row("wall_s", f, "s", f"CI has 0 or <= {TIME_GOAL_PCT:g} %", ok))
    why = f"{fmt(f.slope, 2)} ± {fmt(f.half_ci, 2)} s per 100 iterations ({fmt(f.pct, 1)} %)" if decided(f) else None
    verdicts.append(("iteration time", ok, why or undecided(f)))
    phases = sorted({k for s in post for k in s if k.startswith("phase_s/")})
    for metric in phases:
        xs, ys, gs = series(post, metric)
        lines.append(row(metric, fit(xs, ys, gs), "s"))

    api = [s for s in samples if any(k.startswith("api_ms/") for k in s)]
    prefect_keys = ("api_ms/", "prefect/", "db_rows/", "prefect_log/")
    if api:
        lines += ["", f"Prefect API, the UI's queries ({len(api)} samples; ms, all segments)", header]
        for metric in sorted({k for s in api for k in s if k.startswith(prefect_keys)}):
            xs, ys, _ = series(api, metric)
            lines.append(row(metric, fit(xs, ys), "ms" if metric.startswith("api_ms") else ""))
        last = api[-1]
        counts = ", ".join(
            f"{k.removeprefix('prefect/')} {int(v):,}" for k, v in last.items() if k.startswith("prefect/")
        )
        lines.append(f"  at iteration {last['iteration']}: {counts}")

    lines += ["", "verdicts"]
    for what, ok, why in verdicts:
        lines.append(f"  {what:<15} {'-' if ok is None else ('OK' if ok else 'FAILS'):<6} {why}")
    return "\n".join(line for line in lines if line is not None)


def flat_rows(samples: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    keys: list[str] = []
    for s in samples:
        keys += [k for k in s if k not in keys]
    return keys, [[s.get(k, "") for k in keys] for s in sorted(samples, key=lambda s: s["iteration"])]


def plot(samples: list[dict[str, Any]], kills: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    live = sorted(
        (s for s in samples if not s.get("late") and s.get("procs/flow", 1) > 0), key=lambda s: s["iteration"]
    )
    every = sorted(samples, key=lambda s: s["iteration"])
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))

    def draw(ax: Any, rows: list[dict[str, Any]], metrics: Sequence[str], ylabel: str, name: Any = None) -> None:
        for m in metrics:
            xs, ys, _ = series(rows, m)
            if ys and max(ys) > 0:
                ax.plot(xs, ys, ".-", ms=3, lw=0.8, label=name(m) if name else m)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
        for k in kills:
            ax.axvline(k["after_iteration"] + 0.5, color="red", lw=0.5, alpha=0.5)

    draw(axes[0, 0], live, [f"rss_mb/{r}" for r in (*ROLES, "total")], "resident memory (MB)", lambda m: m[7:])
    disks = ["disk_mb/checkpoints", "disk_mb/other", "disk_mb/prefect_db", "disk_mb/logs", "disk_mb/ray_session"]
    draw(axes[0, 1], every, disks, "MB", lambda m: m[8:])
    phases = sorted({k for s in every for k in s if k.startswith("phase_s/")})
    draw(axes[0, 2], every, ["wall_s", *phases], "seconds", lambda m: m.removeprefix("phase_s/"))
    twin = axes[0, 2].twinx()
    xs, ys, _ = series(every, "load1")
    twin.plot(xs, ys, color="grey", lw=0.6, alpha=0.6)
    twin.set_ylabel("load average (1 min)", color="grey")
    draw(axes[1, 0], live, ["fds/total", "threads/total", "procs/total"], "count", lambda m: m.removesuffix("/total"))
    api = sorted({k for s in every for k in s if k.startswith("api_ms/")})
    draw(axes[1, 1], every, api, "ms (Prefect API)", lambda m: m.removeprefix("api_ms/"))
    counts = sorted({k for s in every for k in s if k.startswith("db_rows/")})
    draw(axes[1, 2], every, counts, "rows in the Prefect database", lambda m: m.removeprefix("db_rows/"))
    axes[1, 2].set_yscale("log")
    fig.suptitle(title + ("  (red: kills)" if kills else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def publish(out: Path, dest: Path, text: str) -> None:
    """The raw per-iteration table (CSV), the report and the plot, the bench's events, and kills.jsonl when there
    were kills."""
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines() if line.strip()]
    kills_path = out / "kills.jsonl"
    kills = (
        [json.loads(line) for line in kills_path.read_text().splitlines() if line.strip()]
        if kills_path.exists()
        else []
    )
    meta = json.loads((out / "soak.json").read_text())
    dest.mkdir(parents=True, exist_ok=True)
    keys, rows = flat_rows(samples)
    with open(dest / "samples.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(keys)
        writer.writerows(rows)
    (dest / "report.txt").write_text(text + "\n")
    (dest / "soak.json").write_text(json.dumps(meta, indent=2) + "\n")
    if kills:
        shutil.copy(kills_path, dest / "kills.jsonl")
    if (out / "events.jsonl").exists():  # starts, restarts and resumes of the stack and the run
        shutil.copy(out / "events.jsonl", dest / "events.jsonl")
    plot(samples, kills, dest / "soak.png", f"soak {meta['run_id']}: {len(samples)} iterations")
    print(f"wrote {dest}/samples.csv, report.txt, soak.json, soak.png" + (", kills.jsonl" if kills else ""))
