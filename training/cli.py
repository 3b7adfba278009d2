"""``pettingflow update``: run one policy's update from a config and a batch file, in a learner of its own.

``update`` is a plain function; the main CLI (``pettingflow/cli.py``) calls it after turning plain
trajectories into a batch when needed.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from pettingflow.configs.loader import ConfigError, load_config
from pettingflow.inference.models import resolve_model
from pettingflow.training.checkpoint import PolicyWeights
from pettingflow.training.launch import METRICS_FILE, UpdateError, spec_from_config
from pettingflow.training.learner import run_update


def _fail(message: str, code: int = 2) -> None:
    typer.secho(message, fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _parse_adapters(items: list[str] | None) -> dict[str, str | None] | None:
    if not items:
        return None
    out: dict[str, str | None] = {}
    for item in items:
        agent, sep, folder = item.partition("=")
        if not sep or not agent:
            raise ValueError(f"--adapter takes AGENT=DIR, got {item!r}")
        out[agent] = folder or None
    return out


def update(
    config: Annotated[str, typer.Argument(help="A shipped config name (e.g. code-env) or a path to a YAML file.")],
    batch: Annotated[str, typer.Option("--batch", help="Batch Parquet (local path or fsspec URI) with 'advantage'.")],
    policy: Annotated[str, typer.Option("--policy", help="Policy to update (a name under `policies`).")],
    out: Annotated[str, typer.Option("--out", help="Output folder: local path or fsspec URI.")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Config overrides like training.lr=1e-6.")] = None,
    init: Annotated[
        str | None, typer.Option("--init", help="HF folder of the current weights; default: the policy's model.")
    ] = None,
    base: Annotated[
        str | None, typer.Option("--base", help="HF folder of the KL reference (full weights); default: --init.")
    ] = None,
    adapter: Annotated[
        list[str] | None, typer.Option("--adapter", help="LoRA: AGENT=DIR of the previous adapter (repeatable).")
    ] = None,
    resume: Annotated[
        str | None, typer.Option("--resume", help="A previous job's deepspeed/ folder (weights + optimizer).")
    ] = None,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Seconds before the job is killed.")] = None,
    iteration: Annotated[
        int, typer.Option("--iteration", help="The iteration this update stands for: seed and snapshot cadence.")
    ] = 0,
    save_optimizer: Annotated[
        bool | None,
        typer.Option(
            "--save-optimizer/--no-save-optimizer",
            help="Write deepspeed/ (optimizer snapshot); default: as the flow's update of --iteration "
            "(training.save_optimizer_every, training.replay_snapshots).",
        ),
    ] = None,
) -> None:
    """Update POLICY on BATCH with the training/algorithm settings of CONFIG; print where the results are."""
    try:
        cfg = load_config(config, overrides or [])
        settings = cfg.policy(policy)
        init_dir = init or str(resolve_model(settings.model))  # a prepared model's name, or an HF folder
        adapters = _parse_adapters(adapter) or {}
        start = PolicyWeights(
            policy=policy,
            base_dir=base or init_dir,
            model_dir=init_dir,
            adapters={a: f for a, f in adapters.items() if f},
            deepspeed_dir=resume,
            source="cli",
        )
        spec = spec_from_config(
            cfg,
            policy=policy,
            batch_uri=batch,
            out_dir=out,
            start=start,
            iteration=iteration,
            save_optimizer=save_optimizer,
        )
    except (ConfigError, KeyError, ValueError, FileNotFoundError) as exc:
        _fail(str(exc).strip('"'))
    try:
        metrics = run_update(spec, timeout_s=timeout)
    except UpdateError as exc:
        _fail(str(exc), code=1)
    out_dir = out.rstrip("/")
    typer.echo(f"metrics:    {out_dir}/{METRICS_FILE}")
    if metrics.get("skipped"):
        typer.echo("skipped:    no trainable rows in the batch; keep the previous weights")
        return
    outputs = metrics.get("outputs") or {}
    if outputs.get("model"):
        typer.echo(f"model:      {outputs['model']}")
    for agent, folder in (outputs.get("adapters") or {}).items():
        typer.echo(f"adapter:    {agent} -> {folder}")
    if outputs.get("deepspeed"):
        typer.echo(f"resume:     {outputs['deepspeed']}")
    summary = {k: metrics.get(k) for k in ("rows_used", "rows_dropped", "loss", "grad_norm", "duration_s")}
    typer.echo(f"summary:    {json.dumps(summary)}")
