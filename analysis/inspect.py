"""Read-only views of stored runs for people: run lists, run summaries, trajectory tables.

Used by the CLI (``pettingflow runs ...``, ``pettingflow trajectories show``) and by ``make run``'s
closing summary; ``timeline_text`` draws when each step ran (``pettingflow runs timeline``, docs/flows.md).
Nothing here writes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from pettingflow.runs.context import STEP_ORDER
from pettingflow.runs.run import format_change
from pettingflow.steps.report import CURVE_FAMILIES, REPORT_STEP, read_metrics, stored_warnings
from pettingflow.storage import RunLayout, list_runs, read_step_trajectories
from pettingflow.storage.layout import StepName, update_policy


def run_rows(root: str, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per run: id, iterations with a committed report, config name, created."""
    rows = []
    for run_id in list_runs(root, storage_options):
        layout = RunLayout(root, run_id, storage_options)
        try:
            info = layout.read_run_info()
        except FileNotFoundError:
            continue
        done = [k for k in layout.iterations() if layout.step(k, REPORT_STEP).is_committed()]
        planned = info.get("config", {}).get("run", {}).get("iterations")
        rows.append(
            {
                "run_id": run_id,
                "config": info.get("config_name"),
                "iterations": f"{len(done)}/{planned}",
                "created": info.get("created", "")[:19],
                "evaluates": json.dumps(info["evaluates"]) if "evaluates" in info else "",
            }
        )
    return rows


def step_status(layout: RunLayout, iteration: int) -> dict[str, str]:
    """Each step of an iteration (attempt 0): committed, or missing."""
    status = {}
    names = [n for n in STEP_ORDER if n is not StepName.UPDATE]
    if layout.fs.exists(layout.step(iteration, StepName.BASELINE).path):  # iteration 0 with validation.at_start
        names.insert(0, StepName.BASELINE)
    names += layout.update_steps(iteration) + layout.optimizer_steps(iteration)
    for name in names:
        step = layout.step(iteration, name)
        status[name] = (
            "committed" if step.is_committed() else ("in flight / crashed" if layout.fs.exists(step.path) else "-")
        )
    return status


def show_run(layout: RunLayout, console: Console) -> None:
    info = layout.read_run_info()
    console.print(
        f"[bold]run[/bold] {layout.run_id}  ({info.get('config_name')}, created {info.get('created', '')[:19]})"
    )
    console.print(f"location: {layout.run_uri}")
    if info.get("overrides"):
        console.print(f"overrides: {' '.join(info['overrides'])}")
    for k in layout.iterations():
        status = step_status(layout, k)
        attempts = layout.attempts(k)[1:]
        table = Table(title=f"iteration {k}" + (f" (re-runs: {attempts})" if attempts else ""), show_lines=False)
        table.add_column("step")
        table.add_column("state")
        table.add_column("contents", justify="right")
        for name, state in status.items():
            step = layout.step(k, name)
            size = ""
            if state == "committed":
                manifest = step.manifest()
                has_rows = any(f.rows is not None for f in manifest.files)
                n = len(manifest.files)
                size = f"{manifest.rows} rows" if has_rows else f"{n} file" + ("s" if n != 1 else "")
                pruned = manifest.metadata.get("pruned")
                if pruned:  # `pettingflow runs prune` removed checkpoint folders from it
                    gone = sorted({p.rstrip("/") for entry in pruned for p in entry.get("prefixes", [])})
                    state = f"committed ({', '.join(gone)} pruned)"
            table.add_row(name, state, size)
        console.print(table)
        for line in attempt_lines(layout, k) + optimizer_lines(layout, k):
            console.print(line, markup=False)
        reports = attempt_metrics(layout, k)
        if len(reports) > 1:  # re-runs: the headline metrics of every attempt side by side
            console.print(attempts_table(reports, k))
        elif reports:
            metrics = next(iter(reports.values()))
            for key in [m for m in sorted(metrics) if _headline(m)]:
                console.print(f"  {key:<48} {metrics[key]:.4f}")
        report = layout.step(k, REPORT_STEP)
        if report.is_committed():
            for warning in stored_warnings(report):
                console.print(f"  [bold red]warning:[/bold red] {warning}", highlight=False)


def attempt_metrics(layout: RunLayout, iteration: int) -> dict[int, dict[str, float]]:
    """``{attempt: metrics}`` of every attempt of ``iteration`` whose report is committed (0 = the original)."""
    out = {}
    for attempt in layout.attempts(iteration):
        report = layout.step(iteration, REPORT_STEP, attempt=attempt or None)
        if report.is_committed():
            out[attempt] = read_metrics(report)
    return out


def attempts_table(reports: dict[int, dict[str, float]], iteration: int) -> Table:
    """Headline metrics, one column per attempt (blank where an attempt did not record the metric)."""
    table = Table(title=f"iteration {iteration}: metrics by attempt", show_lines=False)
    table.add_column("metric")
    for attempt in reports:
        table.add_column(f"attempt {attempt}" + (" (original)" if attempt == 0 else ""), justify="right")
    keys = sorted({m for metrics in reports.values() for m in metrics if _headline(m)})
    for key in keys:
        cells = [
            f"{metrics[key]:.4f}" if isinstance(metrics.get(key), int | float) else "" for metrics in reports.values()
        ]
        table.add_row(key, *cells)
    return table


def attempt_lines(layout: RunLayout, iteration: int) -> list[str]:
    """One line per re-run of ``iteration``: where it started and what its config changed versus run.json."""
    lines = []
    for attempt in layout.attempts(iteration)[1:]:
        info = layout.read_attempt_info(iteration, attempt) or {}
        changes = info.get("config_changes")
        changed = "; ".join(format_change(c) for c in changes) if changes else "no config changes"
        if changes is None:
            changed = "config not recorded (a re-run stored before attempt.json existed)"
        report = (
            "report committed" if layout.step(iteration, REPORT_STEP, attempt=attempt).is_committed() else "no report"
        )
        lines.append(f"  attempt {attempt} (from {info.get('from_step', '?')}, {report}): {changed}")
    return lines


def optimizer_lines(layout: RunLayout, iteration: int) -> list[str]:
    """One line per attempt and policy whose update committed: the optimizer state it started from, with what else
    decides its numbers, and for a re-run whether it replayed the original exactly (``runs/replay.py``)."""
    lines = []
    policies = layout.update_policies(iteration)
    for attempt in layout.attempts(iteration):
        for policy in policies:
            step = layout.step(iteration, StepName.UPDATE.folder(policy), attempt=attempt or None)
            if not step.is_committed():
                continue
            meta = step.manifest().metadata
            m = meta.get("metrics", {})
            who = f"attempt {attempt}" + (" (original)" if attempt == 0 else "")
            if meta.get("skipped") or "optimizer_state" not in m:
                lines.append(f"  optimizer of {policy}, {who}: none (the update was skipped: no rows)")
                continue
            state = str(m["optimizer_state"]) + (f" (age {m['optimizer_age']})" if m.get("optimizer_age") else "")
            how = [state]
            if "global_step_start" in m:
                masters = f"{m.get('master_weights')} masters" if m.get("master_weights") != m.get("dtype") else ""
                how.append(f"from step {m['global_step_start']}")
                how.append(f"{m.get('dtype')}" + (f" ({masters})" if masters else ""))
                ranks = f"{m.get('num_processes')} rank(s), ZeRO-{m.get('zero_stage')}"
                how.append(f"{m.get('torch_threads')} thread(s), {ranks}")
            if attempt:
                exact = m.get("exact_replay")
                how.append(
                    "exact replay"
                    if exact
                    else "not an exact replay: " + (m.get("replay_reason") or "not recorded (a re-run from before)")
                )
            lines.append(f"  optimizer of {policy}, {who}: " + ", ".join(how))
    return lines


HEADLINE_UPDATE = (
    "loss",
    "kl",
    "approx_kl",
    "clip_fraction",
    "grad_norm",
    "model_tokens_per_s",
    "duration_s",
    "rows_used",
)


def _headline(metric: str) -> bool:
    """The metrics `runs show` prints: rewards and success, and the main update numbers."""
    if metric.startswith(CURVE_FAMILIES):  # and how the episodes ended: <step>/outcomes/<solved|failed|...>
        return metric.endswith(("/reward_mean", "/success_rate")) or "/outcomes/" in metric
    if metric.startswith(f"{StepName.ADVANTAGES}/"):  # non-zero advantage rows; zero_signal 1 = nothing to learn from
        return metric.endswith(("/nonzero_advantage_rows", "/zero_signal"))
    return metric.startswith("update/") and metric.rsplit("/", 1)[-1] in HEADLINE_UPDATE


def trajectories_table(
    layout: RunLayout, iteration: int, agent: str | None, limit: int, step: str = StepName.ROLLOUTS
) -> Table:
    """A readable table of one iteration's samples: who, reward, mask summary, response start."""
    data = read_step_trajectories(layout.step(iteration, step), agent=agent)
    table = Table(title=f"{layout.run_id} iter-{iteration} {step}: {data.num_rows} rows", show_lines=True)
    for col in ("group", "s", "turn", "agent", "reward", "ok", "episode", "tokens (model/env)", "uid", "response"):
        table.add_column(col, overflow="fold")
    for row in data.slice(0, limit).to_pylist():
        mask = row["response_mask"]
        table.add_row(
            row["group_id"],
            str(row["sample_idx"]),
            str(row["turn_idx"]),
            row["agent_name"],
            f"{row['reward']:.3f}",
            "yes" if row["success"] else "no",
            episode_outcome(row),
            f"{sum(mask)}/{len(mask) - sum(mask)}",
            row["uid"][:8],
            reply_text(row)[:160].replace("\n", " ⏎ "),
        )
    return table


#: How a table row marks the prefill in front of the model's reply (the reply as the agent parsed it).
PREFILL_MARK = "⟦{}⟧"


def reply_text(row: dict[str, Any]) -> str:
    """The reply as the agent's ``parse_response`` read it: the prefill (marked ``⟦…⟧``: written by the prompt,
    not sampled, never trained) followed by the model's text."""
    prefill = row.get("prefill") or ""
    return (PREFILL_MARK.format(prefill) if prefill else "") + row["response_text"]


def episode_outcome(row: dict[str, Any]) -> str:
    """How an episode ended, in words, from any of its rows: solved, failed, ended at max turns, or not finished
    (the ``outcome`` column; derived from ``done``/``truncated`` for rows stored before it, ``analysis/outcomes.py``).
    """
    from pettingflow.analysis.outcomes import outcome_label, row_outcome

    return outcome_label(row_outcome(row))


def episode_text(
    layout: RunLayout, iteration: int, episode: int, step: str = StepName.ROLLOUTS, prompts: bool = True
) -> list[str]:
    """One episode (``rollout_idx``) turn by turn, in full: who acted, reward and success, model/env tokens,
    the UID and the weights that sampled it, the prompt (``prompts``) and the whole response; the advantage
    where the step holds one (``advantages``); tree rollouts show every candidate, the continued one marked.

    Why: a table row cut at 160 characters cannot show what an agent saw and answered, which is what one
    looks for when a reward is surprising.
    """
    import pyarrow.compute as pc

    data = read_step_trajectories(layout.step(iteration, step))
    rows = data.filter(pc.equal(data.column("rollout_idx"), episode)).to_pylist()
    if not rows:
        episodes = sorted(set(data.column("rollout_idx").to_pylist()))
        shown = f"{episodes[:20]}{' ...' if len(episodes) > 20 else ''}"
        raise FileNotFoundError(
            f"no episode {episode} in {layout.run_id} iter-{iteration} {step}: its episodes (rollout_idx) are {shown}"
        )
    rows.sort(key=lambda r: (r["turn_idx"], r.get("branch_idx", 0)))
    first = rows[0]
    lines = [
        f"episode {episode} of {layout.run_id} iter-{iteration} ({step}): env {first['env_name']}, group "
        f"{first['group_id']} sample {first['sample_idx']}, {len(rows)} rows, " + episode_outcome(first),
    ]
    info = json.loads(first["info_json"] or "{}")
    episode_info = {k: v for k, v in info.items() if k != "turn"}
    if episode_info:
        lines.append(f"episode info: {json.dumps(episode_info, sort_keys=True)}")
    for row in rows:
        mask = row["response_mask"]
        head = (
            f"--- turn {row['turn_idx']} · {row['agent_name']} (policy {row['policy_name']}"
            + (f", adapter {row['lora_name']}" if row["lora_name"] else "")
            + f", weights v{row.get('policy_version', 0)}) · reward {row['reward']:.3f} · "
            + ("success" if row["success"] else "no success")
            + f" · tokens {sum(mask)} model / {len(mask) - sum(mask)} env · uid {row['uid'][:8]}"
        )
        if "advantage" in row:
            head += f" · advantage {row['advantage']:+.3f}"
        if row.get("branch_idx", 0) or not row.get("continued", True):
            head += f" · candidate {row.get('branch_idx', 0)}" + (" (continued)" if row.get("continued") else "")
        lines.append(head)
        turn = json.loads(row["info_json"] or "{}").get("turn")
        if turn:
            lines.append(f"turn info: {json.dumps(turn, sort_keys=True)}")
        if prompts:
            lines += ["[prompt]", row["prompt_text"]]
        if row.get("prefill"):
            lines += ["[prefill: written by the prompt, not trained]", row["prefill"]]
        lines += ["[response]", row["response_text"]]
    return lines


def summary_lines(layout: RunLayout, ui: str | None = None, flow_run_id: str | None = None) -> list[str]:
    """What ``make run`` prints at the end: where things are and how to re-run an iteration."""
    iters = layout.iterations()
    lines = [f"run {layout.run_id}", f"  data:         {layout.run_uri}"]
    if iters:
        k = iters[-1]
        lines.append(f"  trajectories: {layout.step(k, StepName.ROLLOUTS).uri}/part-*.parquet")
        lines.append(f"  inspect:      pettingflow trajectories show {layout.run_id} --iteration {k}")
        updates = [layout.step(k, n).uri for n in layout.update_steps(k) if layout.step(k, n).is_committed()]
        for uri in updates:
            lines.append(f"  checkpoint:   {uri}")
        rerun = f"pettingflow rerun {layout.run_id} --iteration {k} --from-step {StepName.FILTERED}"
        lines.append(f"  re-run:       {rerun}")
    if ui:
        lines.append(f"  Prefect UI:   {ui}" + (f"/runs/flow-run/{flow_run_id}" if flow_run_id else ""))
    lines.append(f"  details:      pettingflow runs show {layout.run_id}")
    return lines


# ------------------------------------------------------------------------------------------ timeline
@dataclass(frozen=True)
class Span:
    """One step of one iteration on the wall clock (epoch seconds)."""

    iteration: int
    label: str
    start: float
    end: float


# report ``duration/<name>_s`` -> step folder; the report itself is drawn where its marker was written
_TIMED_STEPS = (StepName.BASELINE, StepName.FILTERED, StepName.ADVANTAGES, StepName.SYNC, StepName.VALIDATION)


def timeline_spans(layout: RunLayout) -> list[Span]:
    """When each step of each iteration (attempt 0) ran, rebuilt from the committed steps, oldest first.

    Rollouts: ``started_at``/``finished_at`` in their manifest (a collection ahead, ``rollout.async_rollouts``, is
    labelled so: it ran in the previous iteration's subflow, beside its update). Other steps: they end at their
    marker's ``committed_at`` and last the report's ``duration/<step>_s`` (an update at least its own
    ``duration_s``); the wait for the next rollouts follows the last update; the report is a point (``*``). Steps
    committed by an earlier, crashed flow run keep their own times."""
    spans: list[Span] = []
    for k in layout.iterations():
        report = layout.step(k, REPORT_STEP)
        metrics = read_metrics(report) if report.is_committed() else {}
        previous = layout.step(k - 1, REPORT_STEP) if k else None
        ahead = bool(
            previous and previous.is_committed() and "async/next_rollouts_s" in previous.read_json("metrics.json")
        )
        rollouts = layout.step(k, StepName.ROLLOUTS)
        if rollouts.is_committed():
            meta = rollouts.manifest().metadata
            if meta.get("started_at") is not None and meta.get("finished_at") is not None:
                label = f"{StepName.ROLLOUTS} (ahead)" if ahead else StepName.ROLLOUTS
                spans.append(Span(k, label, float(meta["started_at"]), float(meta["finished_at"])))
        updates_end = None
        for name in [*_TIMED_STEPS, *layout.update_steps(k)]:
            step = layout.step(k, name)
            if not step.is_committed():
                continue
            manifest = step.manifest()
            seconds = float(metrics.get(f"duration/{name}_s", 0.0))
            if update_policy(name):
                seconds = max(seconds, float((manifest.metadata.get("metrics") or {}).get("duration_s") or 0.0))
                updates_end = max(updates_end or 0.0, manifest.committed_at)
            spans.append(Span(k, name, manifest.committed_at - seconds, manifest.committed_at))
        wait = float(metrics.get("duration/wait_next_rollouts_s", 0.0))
        if updates_end is not None and wait > 0:
            spans.append(Span(k, "wait for next rollouts", updates_end, updates_end + wait))
        if report.is_committed():
            at = report.manifest().committed_at
            spans.append(Span(k, REPORT_STEP, at, at))
    return sorted(spans, key=lambda s: (s.start, s.iteration, s.end))


def timeline_text(layout: RunLayout, width: int = 64) -> str:
    """A text Gantt chart of the run (``timeline_spans``), one line per step, and what each iteration's report
    says about the rollouts it collected ahead (``async/*``): how long, how much of it beside the update."""
    spans = timeline_spans(layout)
    if not spans:
        return f"run {layout.run_id}: no committed steps"
    t0 = min(s.start for s in spans)
    total = max(max(s.end for s in spans) - t0, 1e-9)
    scale = total / width
    clock = time.strftime("%H:%M:%S", time.gmtime(t0))
    lines = [
        f"run {layout.run_id}: wall clock from {clock} UTC, one column = {scale:.1f} s",
        f"{'':<32} 0 s{'':>{width - 6}}{total:.0f} s",
    ]
    for s in spans:
        a = min(int((s.start - t0) / scale), width - 1)
        b = max(a + 1, min(width, round((s.end - t0) / scale)))
        bar = " " * a + ("*" if s.end == s.start else "#" * (b - a))
        lines.append(f"{f'iter-{s.iteration} {s.label}':<32}|{bar:<{width}}| {s.start - t0:7.1f} - {s.end - t0:7.1f} s")
    for k in layout.iterations():
        report = layout.step(k, REPORT_STEP)
        metrics = read_metrics(report) if report.is_committed() else {}
        if "async/next_rollouts_s" in metrics:
            lines.append(
                f"iter-{k}: rollouts of iter-{k + 1} collected ahead in {metrics['async/next_rollouts_s']:.1f} s, "
                f"{metrics.get('async/overlap_s', 0.0):.1f} s of it beside the update "
                f"({metrics.get('async/update_s', 0.0):.1f} s)"
            )
    return "\n".join(lines)
