"""Step 7: what a person looks at after an iteration.

Builds, from the committed steps of the iteration, a flat metrics table, a markdown sample of a few
trajectories, and the run's reward/success curve (PNG) over all iterations so far. Also writes the
metrics to TensorBoard (default) and MLflow (when configured). Prefect artifacts are made from these
by ``tasks/report.py``; nothing here knows about Prefect.
"""

from __future__ import annotations

import base64
import io
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pettingflow.faults import maybe_crash
from pettingflow.paths import home
from pettingflow.runs.context import IterationContext
from pettingflow.storage import RunLayout, StepNotCommittedError, read_step_trajectories
from pettingflow.storage.layout import StepName, update_policy

log = logging.getLogger(__name__)

REPORT_STEP = StepName.REPORT

# A metric's family is the step that measured it (``rollouts/<agent>/reward_mean``, ``filtered/rows_kept``,
# ``advantages/<policy>/zero_signal``, ``update/<policy>/loss``, ``validation/...``). Runs stored before the
# families took the step names used ``rollout/``, ``filter/`` and ``signal/``; they are read under today's names,
# so curves, comparisons and learning reports span old and new runs alike.
RENAMED_FAMILIES = {
    "rollout/": f"{StepName.ROLLOUTS}/",
    "filter/": f"{StepName.FILTERED}/",
    "signal/": f"{StepName.ADVANTAGES}/",
}


CURVE_FAMILIES = (f"{StepName.ROLLOUTS}/", f"{StepName.VALIDATION}/", f"{StepName.BASELINE}/")  # per-agent scores


def current_names(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` with families of older runs renamed to today's (see ``RENAMED_FAMILIES``)."""
    out = {}
    for key, value in metrics.items():
        old = next((prefix for prefix in RENAMED_FAMILIES if key.startswith(prefix)), None)
        out[RENAMED_FAMILIES[old] + key.removeprefix(old) if old else key] = value
    return out


def read_metrics(report: Any) -> dict[str, Any]:
    """A committed report step's ``metrics.json``, under today's metric names (``current_names``)."""
    return current_names(report.read_json("metrics.json"))


def flatten(prefix: str, value: Any, out: dict[str, float]) -> None:
    """Nested metrics -> ``a/b/c: float`` (non-numeric leaves are skipped)."""
    if isinstance(value, Mapping):
        for key, inner in value.items():
            flatten(f"{prefix}/{key}" if prefix else str(key), inner, out)
    elif isinstance(value, bool | int | float):
        out[prefix] = float(value)


def env_metric_name(env_name: str) -> str:
    """An env's name as one metric path segment: a class path's ':' is not allowed in MLflow metric names."""
    return env_name.replace(":", ".").replace("/", ".")


def flatten_envs(step: str, metrics: Mapping[str, Any], out: dict[str, float]) -> None:
    """``<step>/env/<env>/...``: a mixed-env step's episodes, tokens and agent scores, env by env (a step of
    one env has no ``envs``: its totals are the env's)."""
    for env_name, values in (metrics.get("envs") or {}).items():
        prefix = f"{step}/env/{env_metric_name(env_name)}"
        for key in ("episodes", "tokens_generated"):
            if key in values:
                out[f"{prefix}/{key}"] = float(values[key])
        for agent, scores in (values.get("agents") or {}).items():
            flatten(f"{prefix}/{agent}", scores, out)


def iteration_metrics(
    outcomes: dict[str, Any], durations: dict[str, float], iteration_s: float | None = None
) -> dict[str, float]:
    """The flat metrics of one iteration, from what the step tasks returned.

    ``iteration_s``: the iteration flow's wall time up to the report. What of it the step tasks do not
    account for is Prefect's and the flow's own cost (``orchestration/...``), visible per iteration.
    """
    flat: dict[str, float] = {}
    rollout = (outcomes.get(StepName.ROLLOUTS) or {}).get("metrics") or {}
    for agent, values in (rollout.get("agents") or {}).items():
        flatten(f"{StepName.ROLLOUTS}/{agent}", values, flat)
    for key in ("tokens_generated", "lookahead_tokens", "tokens_per_s", "episodes", "wall_s", "llm_s", "env_s"):
        if key in rollout:
            flat[f"{StepName.ROLLOUTS}/{key}"] = float(rollout[key])
    flatten(f"{StepName.ROLLOUTS}/outcomes", rollout.get("outcomes") or {}, flat)  # solved, failed, ... counts
    flatten_envs(StepName.ROLLOUTS, rollout, flat)
    filtered = (outcomes.get(StepName.FILTERED) or {}).get("metrics") or {}
    for key in ("rows_in", "rows_kept", "removed_samples", "removed_groups"):
        if key in filtered:
            flat[f"{StepName.FILTERED}/{key}"] = float(filtered[key])
    advantages = (outcomes.get(StepName.ADVANTAGES) or {}).get("metrics") or {}
    for policy, values in (advantages.get("policies") or {}).items():  # is there anything to learn from?
        for key in ("nonzero_advantage_rows", "groups", "groups_varied"):
            if key in values:
                flat[f"{StepName.ADVANTAGES}/{policy}/{key}"] = float(values[key])
        if "nonzero_advantage_rows" in values:
            flat[f"{StepName.ADVANTAGES}/{policy}/zero_signal"] = float(bool(values.get("zero_signal")))
    for name, outcome in outcomes.items():
        if (policy := update_policy(name)) and outcome:
            flatten(f"{StepName.UPDATE}/{policy}", (outcome.get("metrics") or {}).get("metrics", {}), flat)
    for step in (StepName.BASELINE, StepName.VALIDATION):  # baseline: the base weights, before iteration 0's update
        scored = (outcomes.get(step) or {}).get("metrics") or {}
        for agent, values in (scored.get("agents") or {}).items():
            flatten(f"{step}/{agent}", values, flat)
        flatten(f"{step}/outcomes", scored.get("outcomes") or {}, flat)
        flatten_envs(step, scored, flat)
    for key, number in (outcomes.get("async") or {}).items():  # rollouts of k+1 collected beside k's update
        flat[f"async/{key}"] = round(float(number), 3)
    for step, seconds in durations.items():
        flat[f"duration/{step}_s"] = round(seconds, 3)
    if iteration_s:
        outside = max(iteration_s - sum(durations.values()), 0.0)
        flat["duration/iteration_before_report_s"] = round(iteration_s, 3)
        flat["orchestration/outside_step_tasks_s"] = round(outside, 3)
        flat["orchestration/outside_step_tasks_share"] = round(outside / iteration_s, 5)
    return flat


def metrics_table(metrics: Mapping[str, float]) -> list[dict[str, Any]]:
    """Rows ``{metric, value}`` sorted by name, for a table artifact."""
    return [{"metric": k, "value": round(v, 6)} for k, v in sorted(metrics.items())]


def sample_markdown(ctx: IterationContext, n_episodes: int = 2, max_chars: int = 1200) -> str:
    """The first ``n_episodes`` episodes of the iteration, each agent's prompt and response."""
    try:
        table = read_step_trajectories(ctx.step(StepName.ROLLOUTS))
    except StepNotCommittedError:
        return "_no committed rollouts for this iteration_"
    rows = table.select(
        ["group_id", "sample_idx", "turn_idx", "agent_name", "reward", "success", "prompt_text", "response_text"]
    ).to_pylist()
    episodes: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        episodes.setdefault((row["group_id"], row["sample_idx"]), []).append(row)
    parts = [f"# Sample trajectories, run `{ctx.layout.run_id}` {ctx.label}\n"]
    for (group, sample), turns in list(episodes.items())[:n_episodes]:
        parts.append(f"## group {group}, sample {sample}\n")
        for t in sorted(turns, key=lambda r: r["turn_idx"]):
            parts.append(
                f"### turn {t['turn_idx']}: `{t['agent_name']}` — reward {t['reward']:.3f}, "
                f"success {bool(t['success'])}\n\n**prompt (last message)**\n\n"
                f"```text\n{_clip(t['prompt_text'], max_chars)}\n```\n\n"
                f"**response**\n\n```text\n{_clip(t['response_text'], max_chars)}\n```\n"
            )
    return "\n".join(parts)


def _clip(text: str, limit: int) -> str:
    text = text.replace("```", "'''")
    return text if len(text) <= limit else text[:limit] + f"\n... [{len(text) - limit} more characters]"


def history(layout: RunLayout) -> list[dict[str, Any]]:
    """Every committed report of the run (attempt 0), in iteration order."""
    out = []
    for k in layout.iterations():
        step = layout.step(k, REPORT_STEP)
        if step.is_committed():
            out.append({"iteration": k, **read_metrics(step)})
    return out


def generated_tokens(layout: RunLayout) -> int:
    """Tokens the policies generated in the run's training rollouts so far (committed reports): the
    budget ``run.max_generated_tokens`` counts, so arms are compared at equal generation."""
    return int(sum(report.get(f"{StepName.ROLLOUTS}/tokens_generated", 0.0) for report in history(layout)))


def curve_points(
    original: list[dict[str, Any]], iteration: int, metrics: Mapping[str, Any], attempt: int = 0
) -> list[dict[str, Any]]:
    """The points a report's curve draws, in iteration order. The original (attempt 0) of ``iteration`` is its
    point; a re-run (``attempt`` >= 1) keeps the original's point of every iteration and adds its own scores as
    series of their own (``<family>/<agent> attempt-<a>/...``): its metrics lack what it reused (the rollouts'
    rewards), so putting them in the original's place would drop iteration k from the curve."""
    if not attempt:
        points = [p for p in original if p["iteration"] != iteration] + [{"iteration": iteration, **metrics}]
    else:
        own = {
            f"{key.rsplit('/', 1)[0]} attempt-{attempt}/{key.rsplit('/', 1)[1]}": value
            for key, value in metrics.items()
            if key.startswith(CURVE_FAMILIES)
        }
        points = [*original, {"iteration": iteration, **own}]
    return sorted(points, key=lambda p: p["iteration"])


def curve_png(points: list[dict[str, Any]]) -> bytes:
    """Reward mean and success rate per agent over iterations (rollouts and validation).

    Validation at iteration k scores the weights after k's update; the baseline (``baseline/...``, the base
    weights, stored with iteration 0) is drawn as the validation line's first point, at x = -1 ("base")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    series: dict[str, dict[str, list[tuple[int, float]]]] = {"reward": {}, "success": {}}
    for point in points:
        for key, value in point.items():
            for kind, suffix in (("reward", "/reward_mean"), ("success", "/success_rate")):
                if key.endswith(suffix) and key.startswith(CURVE_FAMILIES) and "/env/" not in key:  # agents only
                    x = point["iteration"]
                    if key.startswith(f"{StepName.BASELINE}/"):
                        key, x = f"{StepName.VALIDATION}/" + key.removeprefix(f"{StepName.BASELINE}/"), x - 1
                    series[kind].setdefault(key[: -len(suffix)], []).append((x, value))
    with_base = any(x < 0 for lines in series.values() for values in lines.values() for x, _ in values)
    for ax, (kind, lines) in zip(axes, series.items(), strict=True):
        for label, values in sorted(lines.items()):
            xs, ys = zip(*sorted(values), strict=True)
            ax.plot(xs, ys, marker="o", label=label, linestyle="--" if label.startswith(StepName.VALIDATION) else "-")
        ax.set_title("reward mean" if kind == "reward" else "success rate")
        ax.set_xlabel("iteration")
        if with_base:
            last = max(int(p["iteration"]) for p in points)
            ticks = list(range(-1, last + 1, max(1, (last + 2) // 10)))
            ax.set_xticks(ticks, ["base" if t < 0 else str(t) for t in ticks])
        ax.grid(alpha=0.3)
        if lines:
            ax.legend(fontsize=7)
    return figure_png(fig)


def figure_png(fig: Any) -> bytes:
    """A matplotlib figure as PNG bytes (the figure is closed: pyplot keeps every open one alive)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def png_markdown(png: bytes, title: str) -> str:
    """Markdown embedding the PNG inline, so the Prefect UI shows it without a file server."""
    return f"# {title}\n\n![{title}](data:image/png;base64,{base64.b64encode(png).decode()})\n"


def tensorboard_dir(layout: RunLayout) -> Path:
    """Local runs write TensorBoard events beside their data; remote roots use $PETTINGFLOW_HOME."""
    local = Path(layout.run_path) if _is_local(layout) else home() / "tensorboard" / layout.run_id
    return local / "tensorboard"


def _is_local(layout: RunLayout) -> bool:
    from pettingflow.storage.fs import is_local

    return is_local(layout.fs)


def log_metrics(
    layout: RunLayout, iteration: int, metrics: Mapping[str, float], mlflow_uri: str | None, attempt: int = 0
) -> None:
    """TensorBoard always; MLflow too when a tracking URI is configured.

    A re-run (``attempt`` >= 1 of ``iteration``) is its own TensorBoard run, ``iter-<k>-attempt-<a>`` inside the
    run's log folder: the same metric tags at step k, so each chart shows the re-run's point beside the
    original curve (TensorBoard names runs by their sub-folder). In MLflow every report of a training run goes to
    one MLflow run (``steps/mlflow_sink.py``), a re-run's metrics under ``attempt-<a>/``.
    """
    from torch.utils.tensorboard import SummaryWriter

    log_dir = tensorboard_dir(layout)
    if attempt:
        log_dir = log_dir / f"iter-{iteration}-attempt-{attempt}"
    writer = SummaryWriter(log_dir=str(log_dir))
    try:
        for key, value in metrics.items():
            writer.add_scalar(key, value, global_step=iteration)
    finally:
        writer.close()
    if mlflow_uri:
        from pettingflow.steps.mlflow_sink import log_report

        info = layout.read_run_info()
        log_report(mlflow_uri, layout.run_id, layout.run_uri, info.get("config", {}), iteration, metrics, attempt)


def iteration_warnings(outcomes: Mapping[str, Any]) -> list[str]:
    """What a person must not miss about an iteration: each policy that had nothing to learn from."""
    from pettingflow.steps.batches import zero_signal_policies

    advantages = (outcomes.get(StepName.ADVANTAGES) or {}).get("metrics") or {}
    return list(zero_signal_policies(advantages).values())


def stored_warnings(step: Any) -> list[str]:
    """A committed report's warnings (``warnings.json``); none for reports written before it existed."""
    return step.read_json("warnings.json") if "warnings.json" in step.files() else []


def warnings_markdown(warnings: list[str], label: str) -> str:
    return f"# Warnings, {label}\n\n" + "\n".join(f"- **{w}**" for w in warnings) + "\n"


def write_report(
    ctx: IterationContext, metrics: Mapping[str, float], links: Mapping[str, str], warnings: list[str] | None = None
) -> dict[str, Any]:
    """Commit the report step (metrics.json, samples.md, links.json, curve.png, warnings.json) and return its
    contents."""
    step = ctx.step(REPORT_STEP)
    if step.is_committed():
        metrics = read_metrics(step)
        return {"uri": step.uri, "skipped": True, "metrics": metrics, "warnings": stored_warnings(step)}
    samples = sample_markdown(ctx)
    png = curve_png(curve_points(history(ctx.layout), ctx.iteration, metrics, ctx.attempt))
    maybe_crash("report:mid", step.path)  # kill matrix: metrics and curve made, nothing written
    step.begin()
    step.write_json("metrics.json", dict(metrics))
    step.write_bytes("samples.md", samples.encode())
    step.write_json("links.json", dict(links))
    step.write_bytes("curve.png", png)
    step.write_json("warnings.json", list(warnings or []))
    step.commit({"metrics": len(metrics)})
    return {
        "uri": step.uri,
        "skipped": False,
        "metrics": dict(metrics),
        "samples": samples,
        "png": png,
        "warnings": list(warnings or []),
    }


def cached_probe() -> dict[str, Any] | None:
    """This machine's ``pettingflow hardware probe`` result, or None (never probes: that would compete with the run)."""
    from pettingflow import hardware_probe

    return hardware_probe.load()


def roofline_metrics(config: Any, metrics: Mapping[str, float], probe: Mapping[str, Any] | None) -> dict[str, float]:
    """The iteration's phases against this machine's measured peaks (``pettingflow/roofline.py``), from a cached
    ``pettingflow hardware probe``; nothing without one (probing here would compete with the run).

    ``roofline/update/<policy>/tflops`` and ``.../fraction_of_peak``: the training pass's matmul FLOP/s and its
    share of what the probe's multiplies at this model's shapes reach; ``roofline/generation/fraction_of_bound``:
    generated tokens/s over the decode bandwidth bound at the rollout's concurrency."""
    if not probe:
        return {}
    from pettingflow.inference.models import resolve_model
    from pettingflow.inference.server import server_dtype
    from pettingflow.roofline import ModelShape, decode_bound, model_shape_peak, update_fraction
    from pettingflow.training.model import resolve_dtype

    out: dict[str, float] = {}
    shapes = {}
    for policy in config.policies:
        try:
            shapes[policy.name] = ModelShape.from_config(
                json.loads((resolve_model(policy.model) / "config.json").read_text())
            )
        except (OSError, ValueError) as exc:
            log.info("no roofline for policy %s: %s", policy.name, exc)
    train = resolve_dtype(config.training.dtype)  # bf16 | fp32, as the learner resolves it
    for name, shape in shapes.items():
        # tokens the forward ran (a shared prompt once per group); older updates only report padded rows' tokens
        tokens_per_s = metrics.get(f"update/{name}/computed_tokens_per_s") or metrics.get(f"update/{name}/tokens_per_s")
        if not tokens_per_s:
            continue
        peak = model_shape_peak(shape, probe["matmul_flops"][train])
        head = metrics.get(f"update/{name}/model_tokens_per_s")
        achieved, fraction = update_fraction(shape, tokens_per_s, peak, head, config.training.gradient_checkpointing)
        out[f"roofline/update/{name}/tflops"] = round(achieved / 1e12, 4)
        out[f"roofline/update/{name}/fraction_of_peak"] = round(fraction, 4)
    generated = metrics.get(f"{StepName.ROLLOUTS}/tokens_per_s")
    if generated and shapes:
        shape = next(iter(shapes.values()))
        serve = server_dtype(config.inference.dtype)  # bfloat16 | float32, as a managed server resolves it
        streams = int(min(config.rollout.max_concurrent_requests, metrics.get(f"{StepName.ROLLOUTS}/episodes") or 1))
        bound = decode_bound(shape, serve, float(probe["bandwidth"]), streams)
        out["roofline/generation/bound_tokens_per_s"] = round(bound, 1)
        out["roofline/generation/fraction_of_bound"] = round(generated / bound, 4)
    return out
