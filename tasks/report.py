"""Publishing an iteration's report (Prefect artifacts, TensorBoard, MLflow) and the run's summary task."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from pettingflow.analysis.viewer import viewer_markdown
from pettingflow.runs.run import RunRef
from pettingflow.steps import report
from pettingflow.storage import StepName

if TYPE_CHECKING:  # the pipeline imports this module: its type only, no import loop
    from pettingflow.tasks.pipeline import StepCall


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")[:100]


def publish_report(call: StepCall) -> dict[str, Any]:
    """The ``report`` step (``tasks/pipeline.py``): commit the iteration's metrics and publish them as Prefect
    artifacts (a metrics table, sample trajectories, links, the curve), to TensorBoard and MLflow."""
    ctx, config = call.ctx, call.config
    outcomes, iteration, attempt = dict(call.outcomes), ctx.iteration, ctx.attempt
    run_id = ctx.layout.run_id
    metrics = report.iteration_metrics(outcomes, dict(call.durations), call.iteration_s)
    metrics |= report.roofline_metrics(config, metrics, report.cached_probe())
    links = {name: o["uri"] for name, o in outcomes.items() if isinstance(o, dict) and "uri" in o}
    result = report.write_report(ctx, metrics, links, report.iteration_warnings(outcomes))
    metrics = result["metrics"]
    key = artifact_key(run_id, f"iter-{iteration}", f"attempt-{attempt}" if attempt else "")
    if result["warnings"]:  # e.g. no learning signal: first, so the UI shows it above the metrics
        create_markdown_artifact(
            key=f"{key}-warnings",
            markdown=report.warnings_markdown(result["warnings"], f"{run_id} {ctx.label}"),
            description="what to look at before trusting this iteration",
        )
    create_table_artifact(
        key=f"{key}-metrics", table=report.metrics_table(metrics), description=f"{run_id} {ctx.label}: metrics"
    )
    samples = result.get("samples") or ctx.step(StepName.REPORT).read_bytes("samples.md").decode()
    create_markdown_artifact(key=f"{key}-samples", markdown=samples, description="sample trajectories")
    link_lines = "\n".join(f"- **{name}**: `{uri}`" for name, uri in sorted(links.items()))
    create_markdown_artifact(
        key=f"{key}-links",
        markdown=f"# Files of {run_id} {ctx.label}\n\n{link_lines}\n\nReport: `{result['uri']}`\n\n"
        + viewer_markdown(run_id, iteration, attempt)
        + "\n",
        description="where the Parquet and checkpoints are",
    )
    if ctx.layout.fs.protocol in ("file", "local") or "file" in ctx.layout.fs.protocol:
        create_link_artifact(
            key=f"{key}-report", link=f"file://{ctx.step(StepName.REPORT).path}", description="report folder"
        )
    png = result.get("png") or ctx.step(StepName.REPORT).read_bytes("curve.png")
    create_markdown_artifact(**curve_artifact(run_id, iteration, attempt, png))
    report.log_metrics(ctx.layout, iteration, metrics, config.run.mlflow_tracking_uri, attempt=attempt)
    info = ctx.layout.read_attempt_info(iteration, attempt) if attempt else None
    get_run_logger().info(report_line(iteration, attempt, metrics, info))
    return {"uri": result["uri"], "metrics": metrics}


def curve_artifact(run_id: str, iteration: int, attempt: int, png: bytes) -> dict[str, str]:
    """The curve artifact of a report (``create_markdown_artifact``'s arguments). The original's reports update the
    run-wide ``<run>-curve``; a re-run publishes its own ``<run>-iter-<k>-attempt-<a>-curve`` (the original's
    curve with the re-run's scores beside it, ``steps/report.curve_points``), so re-running never changes what the
    UI shows for the original."""
    if not attempt:
        return {
            "key": artifact_key(run_id, "curve"),
            "markdown": report.png_markdown(png, f"Reward and success, run {run_id}"),
            "description": "reward/success per iteration (updated every iteration)",
        }
    return {
        "key": artifact_key(run_id, f"iter-{iteration}", f"attempt-{attempt}", "curve"),
        "markdown": report.png_markdown(
            png, f"Reward and success, run {run_id}, with re-run iter-{iteration}/attempt-{attempt}"
        ),
        "description": f"the original run's curve with re-run attempt {attempt} of iteration {iteration} beside it",
    }


#: the update numbers a report's log line shows (success rates are always shown)
LOGGED_UPDATE = ("loss", "grad_norm", "optimizer_exact")


def report_line(iteration: int, attempt: int, metrics: dict[str, Any], info: dict[str, Any] | None = None) -> str:
    """The report task's log line: the success rates and outcome counts and, for a re-run, what was re-run (from
    which step, with which overrides, from ``attempt.json``: ``info``) and its update's headline numbers; a re-run
    has no rollouts of its own, so success rates alone would log ``{}``."""
    # success rates over every episode, and how the episodes ended (<step>/outcomes/<label>): a rate alone does not
    # say how many episodes failed or ran out of turns
    shown = {k: v for k, v in metrics.items() if "/success_rate" in k or "/outcomes/" in k}
    if not attempt:
        return f"iteration {iteration}: {_numbers(shown)}"
    shown |= {k: v for k, v in metrics.items() if k.startswith("update/") and k.rsplit("/", 1)[-1] in LOGGED_UPDATE}
    info = info or {}
    overrides = " ".join(info.get("overrides") or []) or "none (the run's own config)"
    return (
        f"re-run of iteration {iteration} as attempt {attempt}, from {info.get('from_step', '?')!r}, overrides: "
        f"{overrides}: {_numbers(shown)}"
    )


def _numbers(metrics: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(metrics.items())) or "-"


@task(name="summarize_run", cache_policy=NO_CACHE)
def summarize_run(run: RunRef) -> dict[str, Any]:
    """What the run did, as its last artifact, in the log and as ``summary.md``/``summary.json`` beside
    ``run.json``: training reward per iteration, held-out success before -> after with a 95 % interval,
    tokens, wall time per phase, and any iteration without a learning signal (``analysis.summary``)."""
    from pettingflow.analysis.summary import summarize_run as summarize
    from pettingflow.analysis.summary import summary_json, summary_lines, summary_markdown

    layout = run.layout()
    summary = summarize(layout)
    markdown = summary_markdown(summary)
    uri = layout.write_run_file("summary.md", markdown.encode())
    layout.write_run_file("summary.json", summary_json(summary).encode())
    create_markdown_artifact(
        key=artifact_key(run.run_id, "summary"), markdown=markdown, description="what happened in this run"
    )
    logger = get_run_logger()
    for line in summary_lines(summary):
        logger.info(line)
    return {"uri": uri, "heldout": summary.heldout.__dict__ if summary.heldout else None}
