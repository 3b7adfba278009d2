"""The ``pettingflow`` command line. Each command is a thin shell over library code."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from pettingflow.configs.loader import ConfigError, available_configs, dump_config, load_config
from pettingflow.inference.cli import models_app
from pettingflow.storage.layout import StepName

if TYPE_CHECKING:
    from pettingflow.configs.settings import ExperimentConfig
    from pettingflow.runs.evaluation import Weights
    from pettingflow.runs.preflight import PreflightReport
    from pettingflow.storage import RunLayout

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="PettingFlow: multi-agent RL, one Prefect flow per iteration."
)
config_app = typer.Typer(no_args_is_help=True, help="Inspect experiment configs.")
runs_app = typer.Typer(no_args_is_help=True, help="Inspect stored runs.")
traj_app = typer.Typer(no_args_is_help=True, help="Inspect stored trajectories.")
hardware_app = typer.Typer(no_args_is_help=True, help="This machine's measured peaks (the roofline's ceiling).")
env_app = typer.Typer(no_args_is_help=True, help="Environments as services (docs/env-service.md).")
app.add_typer(config_app, name="config")
app.add_typer(models_app, name="models")
app.add_typer(runs_app, name="runs")
app.add_typer(traj_app, name="trajectories")
app.add_typer(hardware_app, name="hardware")
app.add_typer(env_app, name="env")

Overrides = Annotated[
    list[str] | None,
    typer.Argument(
        help="Config overrides KEY=VALUE, e.g. algorithm.filter_ratio=0.25; a list entry by index or name: "
        "agents[1].sampling.temperature=0.7, agents.code_generator.policy=shared (docs/reference/config.md, "
        "'Overrides')."
    ),
]
RootOpt = Annotated[
    str,
    typer.Option(
        "--root",
        help="Storage root (default: where this machine's run index says the run is, else run.storage_root of "
        "code-env).",
    ),
]


def fail(message: str, code: int = 2) -> None:
    """Print an error for a person (no traceback) and exit non-zero."""
    typer.secho(message, fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _config(name: str, overrides: list[str] | None):
    try:
        return load_config(name, overrides or [])
    except ConfigError as exc:
        fail(str(exc))


def _default_root() -> str:
    return load_config("code-env").run.storage_root


def _root_for(run_id: str | None, root: str) -> str:
    """``--root`` if given, else the root the run index recorded for ``run_id`` (runs started on this machine,
    with any config and from any folder), else the default config's root."""
    if root:
        return root
    from pettingflow.storage.run_index import find_run

    entry = find_run(run_id) if run_id else None
    return entry["root"] if entry else _default_root()


# ------------------------------------------------------------------------------------------ config
@config_app.command("show")
def config_show(
    name: Annotated[str, typer.Argument(help="A shipped config name (e.g. code-env) or a path to a YAML file.")],
    overrides: Overrides = None,
) -> None:
    """Print the resolved config (defaults filled in, overrides applied) as YAML."""
    sys.stdout.write(dump_config(_config(name, overrides)))


@config_app.command("list")
def config_list() -> None:
    """List the configs shipped in configs/."""
    for name in available_configs():
        typer.echo(name)


# ------------------------------------------------------------------------------------------ rollout
def _preflight(name: str, cfg: ExperimentConfig, check_models: bool = True) -> PreflightReport:
    """``runs.preflight`` of a loaded config, or a one-line error naming the config (exit 2)."""
    from pettingflow.runs.preflight import PreflightError, preflight

    try:
        return preflight(cfg, check_models=check_models)
    except PreflightError as exc:
        fail(f"{name}: {exc}")


@app.command("check")
def check(
    config: Annotated[str, typer.Argument(help="Config name or YAML path.")],
    overrides: Overrides = None,
    tasks: Annotated[
        str, typer.Option("--tasks", help="A task file to use (sets env.dataset.source=file, env.dataset.path).")
    ] = "",
    models: Annotated[bool, typer.Option("--models/--no-models", help="Also check each policy's model.")] = True,
) -> None:
    """Check a config before a run: class paths resolve, the task file loads, every task's env has a team, the
    models exist. Starts nothing; exits 2 with what is wrong and where."""
    extra = ["env.dataset.source=file", f"env.dataset.path={tasks}"] if tasks else []
    report = _preflight(config, _config(config, [*(overrides or []), *extra]), check_models=models)
    for line in report.lines():
        typer.echo(line)
    typer.secho(f"{config}: ok", fg=typer.colors.GREEN)


@app.command("train")
def train(
    config: Annotated[str, typer.Argument(help="Config name or YAML path.")],
    overrides: Overrides = None,
    run_id: Annotated[str, typer.Option("--run-id", help="Resume this run (same config and overrides).")] = "",
) -> None:
    """Train in the foreground: the flow `prefect deployment run train/...` runs, here, with its log in this
    terminal (against PREFECT_API_URL if set, so the UI shows it; else a temporary local Prefect server).
    Checks the config first (`pettingflow check`)."""
    _preflight(config, _config(config, overrides))
    if os.environ.get("PREFECT_API_URL") is None:
        typer.secho("PREFECT_API_URL is not set: running with a temporary local Prefect server", err=True)
    from pettingflow.flows.train import train as train_flow
    from pettingflow.runs.disk_guard import DiskSpaceError

    try:
        result = train_flow(config=config, overrides=list(overrides or []), run_id=run_id or None)
    except DiskSpaceError as exc:  # the disk guard stopped the run at a step boundary: its message says what to do
        typer.secho(f"run stopped: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(3) from None
    typer.echo(f"run {result['run_id']}: {len(result['iterations'])} iteration(s) at {result['uri']}")
    typer.echo(f"next: pettingflow runs summary {result['run_id']}")


@app.command("rollout")
def rollout(
    config: Annotated[str, typer.Argument(help="Config name or YAML path.")],
    out: Annotated[str, typer.Option("--out", help="Storage root for the run (local path or fsspec URI).")],
    limit: Annotated[
        int | None, typer.Option("--limit", help="Collect N tasks (default: env.tasks_per_iteration).")
    ] = None,
    overrides: Overrides = None,
) -> None:
    """Collect one round of rollouts with the configured policies into a committed trajectory step.

    Starts a vLLM server per policy unless inference.url is set.
    """
    from pettingflow.runs.context import IterationContext
    from pettingflow.runs.run import start_or_resume
    from pettingflow.runs.runtime import Runtime
    from pettingflow.steps.rollouts import collect_step

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    extra = [f"run.storage_root={out}", *([f"env.tasks_per_iteration={limit}"] if limit else [])]
    cfg = _config(config, [*(overrides or []), *extra])
    ref, _ = start_or_resume(cfg, config, list(overrides or []), None, {"command": "rollout"})
    with Runtime(cfg, ref.run_id) as runtime:
        outcome = collect_step(IterationContext(ref.layout(), 0), cfg, runtime.endpoints(), env_cache=runtime.env_cache)
    typer.echo(f"committed {outcome.rows} rows: {outcome.uri}")
    for agent, values in (outcome.metrics.get("agents") or {}).items():
        typer.echo(
            f"  {agent}: reward {values['reward_mean']:.3f} ± {values['reward_std']:.3f}, "
            f"success {values['success_rate']:.2f}"
        )


# ------------------------------------------------------------------------------------------ update
@app.command("update")
def update(
    config: Annotated[str, typer.Argument(help="Config name or YAML path (training and algorithm settings).")],
    batch: Annotated[str, typer.Option("--batch", help="Batch Parquet: trajectory columns + advantage.")],
    policy: Annotated[str, typer.Option("--policy", help="Which policy of the config to update.")],
    out: Annotated[str, typer.Option("--out", help="Output folder (local path or fsspec URI).")],
    init: Annotated[
        str | None, typer.Option("--init", help="HF folder of the current weights (default: the policy's model).")
    ] = None,
    iteration: Annotated[
        int, typer.Option("--iteration", help="The iteration it stands for (seed, snapshot cadence), as in the flow.")
    ] = 0,
    overrides: Overrides = None,
) -> None:
    """Run one update from a stored batch (e.g. to re-run an iteration's update by hand), in a learner of its own.

    BATCH may also be plain trajectories (e.g. from `pettingflow rollout`): the config's filter and
    advantage estimator are then applied first, and the batch is written to OUT/batch-<policy>.parquet.
    """
    from pettingflow.training.cli import update as run_update_cli

    cfg = _config(config, overrides)
    batch = _as_batch(batch, cfg, policy, out)
    run_update_cli(
        config=config, batch=batch, policy=policy, out=out, init=init, overrides=overrides, iteration=iteration
    )


def _as_batch(uri: str, cfg, policy: str, out: str) -> str:
    """``uri`` if it already holds advantages; else a batch made from its trajectories (written under ``out``)."""
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    from pettingflow.steps.batches import batch_file, filter_table, policy_batch, with_advantages
    from pettingflow.storage.fs import filesystem, join

    fs, path = filesystem(uri)
    dataset = ds.dataset(path, filesystem=fs, format="parquet", exclude_invalid_files=True)
    if "advantage" in dataset.schema.names:
        return uri
    trajectories = dataset.to_table()
    kept, metrics = filter_table(trajectories, cfg)
    table = policy_batch(with_advantages(kept, cfg, episodes=trajectories), policy)
    out_fs, out_path = filesystem(out)
    out_fs.makedirs(out_path, exist_ok=True)
    target = join(out_path, batch_file(policy))
    with out_fs.open(target, "wb") as f:
        pq.write_table(table, f, compression="zstd")
    typer.echo(
        f"{uri} holds trajectories, not a batch: applied filter {metrics['method']} "
        f"({metrics['rows_kept']}/{metrics['rows_in']} rows kept) and {cfg.algorithm.advantage_estimator} "
        f"advantages for policy {policy!r} ({table.num_rows} rows) -> {target}"
    )
    return target


# ------------------------------------------------------------------------------------------ runs
def _existing_run(run_id: str, root: str) -> RunLayout:
    """The layout of a stored run, or a one-line error (a bad id, or no such run under the root)."""
    from pettingflow.storage import RunLayout

    try:
        layout = RunLayout(_root_for(run_id, root), run_id)
    except ValueError as exc:
        fail(str(exc))
    if not layout.fs.exists(layout.run_path):
        fail(f"no run {run_id!r} under {layout.root} (see `pettingflow runs list --root ...`)")
    return layout


@runs_app.command("list")
def runs_list(root: RootOpt = "") -> None:
    """Runs under the storage root (without --root: the default one and every root a run on this machine used),
    oldest first."""
    from rich.console import Console
    from rich.table import Table

    from pettingflow.analysis.inspect import run_rows
    from pettingflow.storage.run_index import recorded_roots, same_root

    roots = [root] if root else [_default_root()]
    if not root:  # and every other root a run on this machine was stored under
        roots += [r for r in recorded_roots() if not any(same_root(r, seen) for seen in roots)]
    for where in roots:
        try:
            rows = run_rows(where)
        except (FileNotFoundError, OSError) as exc:
            typer.secho(f"runs under {where}: not readable ({exc})", err=True)
            continue
        table = Table(title=f"runs under {where}")
        for col in ("run_id", "config", "iterations", "created", "evaluates"):
            table.add_column(col)
        for row in rows:
            table.add_row(*(str(row[c] or "") for c in ("run_id", "config", "iterations", "created", "evaluates")))
        Console().print(table)


@runs_app.command("show")
def runs_show(
    run_id: Annotated[str, typer.Argument(help="A run id (see `pettingflow runs list`).")], root: RootOpt = ""
) -> None:
    """Steps of every iteration (committed or not), row counts and the main metrics."""
    from rich.console import Console

    from pettingflow.analysis.inspect import show_run
    from pettingflow.storage import RunLayout

    try:
        show_run(RunLayout(_root_for(run_id, root), run_id), Console())
    except FileNotFoundError as exc:
        fail(str(exc))


@runs_app.command("timeline")
def runs_timeline(
    run_id: Annotated[str, typer.Argument(help="A run id (see `pettingflow runs list`).")],
    root: RootOpt = "",
    width: Annotated[int, typer.Option("--width", help="Columns of the chart.", min=10)] = 64,
) -> None:
    """When each step of each iteration ran (a text Gantt chart), and how much async rollouts overlapped."""
    from pettingflow.analysis.inspect import timeline_text

    layout = _existing_run(run_id, root)
    typer.echo(timeline_text(layout, width=width))


@runs_app.command("prune")
def runs_prune(
    run_id: Annotated[str, typer.Argument(help="A run id (see `pettingflow runs list`).")],
    root: RootOpt = "",
    keep_last: Annotated[
        int, typer.Option("--keep-last", min=1, help="Keep the newest N updates' checkpoints per policy.")
    ] = 1,
    keep_every: Annotated[
        int, typer.Option("--keep-every", min=0, help="Also keep iteration k when (k+1) % N == 0 (0: none).")
    ] = 0,
    optimizer_only: Annotated[
        bool, typer.Option("--optimizer-only", help="Drop only optimizer snapshots: every iteration stays re-runnable.")
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", help="Delete. Without it, only print what would go.")] = False,
) -> None:
    """Free disk: drop old checkpoints of a run (weights and optimizer snapshots), keep trajectories and metrics.

    An iteration whose starting weights were pruned can no longer be resumed or re-run (it fails, naming the prune)."""
    from pettingflow.runs.retention import plan_prune, prune

    layout = _existing_run(run_id, root)
    targets = plan_prune(layout, keep_last, keep_every, optimizer_only)
    what = "optimizer snapshots" if optimizer_only else "checkpoints (weights and optimizer snapshots)"
    if not targets:
        typer.echo(f"nothing to prune in {run_id}: no {what} outside the kept iterations")
        return
    total = sum(t.bytes for t in targets)
    for t in targets:
        typer.echo(f"  {t.policy} iteration {t.iteration}: {t.files} files, {t.bytes / 1e9:.2f} GB")
    if not yes:
        typer.echo(f"would free {total / 1e9:.2f} GB of {what} in {len(targets)} update steps; add --yes to delete")
        return
    freed = prune(targets, optimizer_only)
    typer.echo(f"freed {freed / 1e9:.2f} GB of {what} in {len(targets)} update steps of {run_id}")


@runs_app.command("learning-report")
def runs_learning_report(
    run_ids: Annotated[
        list[str] | None, typer.Argument(help="Training runs to compare (each needs its evaluate runs).")
    ] = None,
    from_json: Annotated[
        list[str] | None,
        typer.Option(
            "--from-json",
            help="A learning.json written by `learn`, its folder, or a folder of such folders (e.g. one per seed); "
            "repeatable.",
        ),
    ] = None,
    root: RootOpt = "",
    out: Annotated[str, typer.Option("--out", help="Folder or fsspec URI for learning.{json,png,md}.")] = "",
) -> None:
    """Rebuild the `make learn` summary from stored runs and earlier reports: held-out before/after, paired CI,
    curves. Reports (`--from-json`) let a study run over several sessions or machines be combined without its
    run folders."""
    from pettingflow.analysis.learning import (
        arm_from_runs,
        arms_from_learning_json,
        combine_arms,
        write_learning_report,
    )

    if not run_ids and not from_json:
        fail(
            "name training runs, or earlier reports with --from-json PATH "
            "(a learning.json, its folder, or a folder of them)"
        )
    root = root or _default_root()
    try:
        arms = [arm for uri in from_json or [] for arm in arms_from_learning_json(uri)]
        arms += [arm_from_runs(root, run_id) for run_id in run_ids or []]
        arms = combine_arms(arms)
    except (FileNotFoundError, ValueError) as exc:
        fail(str(exc))
    configs = list(dict.fromkeys(a.config for a in arms))
    out = out or f"{root.rstrip('/')}/learning/rebuilt-{'-'.join(configs)}"
    sources = [*(from_json or []), *(run_ids or [])]
    typer.echo(write_learning_report(arms, out, rebuilt_from=sources))
    typer.echo(f"written to {out}/learning.{{json,png,md}}")


@runs_app.command("summary")
def runs_summary(
    run_id: Annotated[str | None, typer.Argument(help="Run id (default: the newest run).")] = None,
    root: RootOpt = "",
    flow_run: Annotated[str | None, typer.Option("--flow-run", help="Prefect flow run id, for the UI link.")] = None,
    ui: Annotated[str | None, typer.Option("--ui", help="Prefect UI address.")] = None,
) -> None:
    """Where a run's trajectories and checkpoints are, how to re-run an iteration, and what happened: training
    reward per iteration, held-out success before -> after with a 95 % interval, tokens, time per phase."""
    from pettingflow.analysis.inspect import summary_lines
    from pettingflow.analysis.summary import summarize_run
    from pettingflow.analysis.summary import summary_lines as what_happened
    from pettingflow.storage import RunLayout, list_runs

    root = _root_for(run_id, root)
    if run_id is None:
        runs = [r for r in list_runs(root) if not r.startswith("eval-")]
        if not runs:
            fail(f"no runs under {root}")
        run_id = runs[-1]
    layout = RunLayout(root, run_id)
    for line in summary_lines(layout, ui=ui, flow_run_id=flow_run or None):
        typer.echo(line)
    typer.echo("")
    for line in what_happened(summarize_run(layout)):
        typer.echo(line)


# ------------------------------------------------------------------------------------------ trajectories
@traj_app.command("show")
def trajectories_show(
    run_id: Annotated[str, typer.Argument(help="A run id.")],
    iteration: Annotated[int, typer.Option("--iteration", "-k", help="Iteration to show.")] = 0,
    agent: Annotated[str | None, typer.Option("--agent", help="Only this agent's samples.")] = None,
    limit: Annotated[int, typer.Option("--limit", help="At most this many rows.")] = 20,
    step: Annotated[
        str, typer.Option("--step", help="rollouts, filtered, validation or baseline.")
    ] = StepName.ROLLOUTS,
    root: RootOpt = "",
) -> None:
    """A readable table of an iteration's samples."""
    from rich.console import Console

    from pettingflow.analysis.inspect import trajectories_table
    from pettingflow.storage import RunLayout, StepNotCommittedError

    try:
        Console(width=max(140, Console().width)).print(
            trajectories_table(RunLayout(_root_for(run_id, root), run_id), iteration, agent, limit, step)
        )
    except (StepNotCommittedError, FileNotFoundError) as exc:
        fail(str(exc))


@traj_app.command("episode")
def trajectories_episode(
    run_id: Annotated[str, typer.Argument(help="A run id.")],
    episode: Annotated[int, typer.Option("--episode", "-e", help="The episode's rollout_idx (see `show`).")] = 0,
    iteration: Annotated[int, typer.Option("--iteration", "-k", help="Iteration.")] = 0,
    step: Annotated[
        str, typer.Option("--step", help="rollouts, filtered, advantages (with each row's advantage), validation.")
    ] = StepName.ROLLOUTS,
    prompts: Annotated[bool, typer.Option("--prompts/--no-prompts", help="Print each turn's prompt.")] = True,
    root: RootOpt = "",
) -> None:
    """One episode turn by turn, in full: agent, reward, tokens, prompt and response of every turn."""
    from pettingflow.analysis.inspect import episode_text
    from pettingflow.storage import RunLayout, StepNotCommittedError

    try:
        lines = episode_text(RunLayout(_root_for(run_id, root), run_id), iteration, episode, step, prompts)
    except (StepNotCommittedError, FileNotFoundError) as exc:
        fail(str(exc))
    typer.echo("\n".join(lines))


@traj_app.command("view")
def trajectories_view(
    run_id: Annotated[str, typer.Argument(help="A run id.")],
    iteration: Annotated[
        int | None, typer.Option("--iteration", "-k", help="Open at this iteration (default: the newest).")
    ] = None,
    port: Annotated[int, typer.Option("--port", help="Port on loopback.")] = 8765,
    host: Annotated[str, typer.Option("--host", help="Loopback address to serve on (no login: loopback only).")] = (
        "127.0.0.1"
    ),
    root: RootOpt = "",
) -> None:
    """Serve a page of the run's episodes turn by turn on loopback: prompts, responses with tokens shaded by mask
    and advantage, rewards, tree candidates, sandbox output; filters; two attempts of an iteration side by side."""
    from pettingflow.analysis.viewer_app import is_loopback, serve
    from pettingflow.storage import RunLayout

    layout = RunLayout(_root_for(run_id, root), run_id)
    iterations = layout.iterations()
    if not iterations:
        fail(f"run {run_id} has no iterations under {layout.run_uri} (is the id right? `pettingflow runs list`)")
    if not is_loopback(host):
        fail(f"--host {host}: the viewer has no login and serves on loopback only; tunnel to it with ssh -L")
    k = iterations[-1] if iteration is None else iteration
    typer.echo(f"trajectory viewer of {run_id}: http://{host}:{port}/iteration/{k}  (Ctrl-C stops it)")
    serve(layout, host, port)


# ------------------------------------------------------------------------------------------ hardware
@hardware_app.command("probe")
def hardware_probe_cmd(
    model: Annotated[
        str, typer.Option("--model", help="Model whose matmul shapes to measure (a prepared name or a folder).")
    ] = "smollm2-135m-instruct",
    threads: Annotated[int, typer.Option("--threads", help="Torch threads (default: every allowed core).")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Measure again even if this machine has a probe.")] = False,
) -> None:
    """Measure matrix-multiply FLOP/s (bf16, fp32; a large shape and the model's own) and memory bandwidth, once
    per machine; iteration reports then give each phase as a fraction of these peaks (roofline/* metrics). Run it
    on an idle machine: anything else running lowers the peaks."""
    import json

    from pettingflow import hardware_probe
    from pettingflow.inference.models import ModelError, resolve_model
    from pettingflow.roofline import ModelShape

    cached = hardware_probe.load(threads or None)
    if cached and not force:
        where = hardware_probe.cache_path(cached["threads"])
        typer.echo(f"this machine was probed at {cached['measured_at']} ({where}); --force measures again")
        typer.echo(json.dumps(cached, indent=2))
        return
    try:
        shape = ModelShape.from_config(json.loads((resolve_model(model) / "config.json").read_text()))
    except (ModelError, OSError, ValueError) as exc:
        fail(f"cannot read the shapes of {model}: {exc}")
    result = hardware_probe.probe(shape, threads or None, progress=typer.echo)
    typer.echo(f"saved {hardware_probe.save(result)}")


# ------------------------------------------------------------------------------------------ env
@env_app.command("serve")
def env_serve(
    name: Annotated[str, typer.Argument(help="A registered env (plan-path, code-env) or 'package.module:Class'.")],
    host: Annotated[
        str, typer.Option("--host", help="Address to listen on; beyond loopback only with a token.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on.", min=1, max=65535)] = 8780,
    token: Annotated[
        str,
        typer.Option(
            "--token",
            help="Bearer token every request must carry (default: $PETTINGFLOW_ENV_TOKEN; the variable keeps it out "
            "of the process list). Required when --host is not loopback.",
        ),
    ] = "",
    idle_timeout_s: Annotated[
        float, typer.Option("--idle-timeout-s", help="Forget an episode nobody touched for this long.", min=1.0)
    ] = 600.0,
    max_episodes: Annotated[
        int, typer.Option("--max-episodes", help="Episodes held at once; more are refused (503).", min=1)
    ] = 10_000,
    code_path: Annotated[
        list[str] | None,
        typer.Option(
            "--code-path",
            help="A folder holding the env's package (repeatable), as run.code_paths in a config: put first on the "
            "import path.",
        ),
    ] = None,
) -> None:
    """Serve an env's episodes over HTTP+JSON (create, observe, step, fork, close; docs/env-service.md); a run
    with env.server=http://HOST:PORT runs its episodes here. Runs until interrupted."""
    from pettingflow.configs.code_paths import absolute_code_paths, activate_code_paths
    from pettingflow.envs.registry import ENV_REGISTRY, RegistryError
    from pettingflow.envs.service.protocol import PROTOCOL, TOKEN_ENV
    from pettingflow.envs.service.server import check_bind, serve

    token = token or os.environ.get(TOKEN_ENV, "")
    try:
        missing = activate_code_paths(absolute_code_paths(code_path or []))
        if missing:
            raise ValueError(f"--code-path {', '.join(missing)}: not a folder here")
        class_path = ENV_REGISTRY.class_path(name)  # imports it: a wrong name or package fails here
        check_bind(host, token or None)
    except (RegistryError, ValueError) as exc:
        fail(str(exc))
    where = f"http://{host}:{port}"
    auth = "bearer token required" if token else "no token (loopback)"
    typer.echo(f"env service {name} ({class_path}) on {where}, protocol {PROTOCOL}, {auth}; Ctrl-C stops it")
    sys.stdout.flush()
    serve(name, host, port, token=token or None, idle_timeout_s=idle_timeout_s, max_episodes=max_episodes)


# ------------------------------------------------------------------------------------------ rerun
@app.command("rerun")
def rerun(
    run_id: Annotated[str, typer.Argument(help="A run id.")],
    iteration: Annotated[int, typer.Option("--iteration", "-k", help="Iteration to re-run.")],
    from_step: Annotated[str, typer.Option("--from-step", help="filtered, advantages or update.")] = StepName.FILTERED,
    validate: Annotated[
        bool, typer.Option("--validate", help="Also sync and validate (starts a vLLM server).")
    ] = False,
    root: RootOpt = "",
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="Overrides of algorithm.*, training.* or validation.*, e.g. training.lr=1e-6."),
    ] = None,
) -> None:
    """Re-run an iteration's later steps from its stored trajectories into a new attempt folder.

    Overrides may change what the stored trajectories do not depend on (algorithm, training, validation):
    e.g. `algorithm.filter_method=std algorithm.filter_ratio=0.5 training.lr=1e-6`. Runs the `rerun` flow here
    (against PREFECT_API_URL if set, else a temporary local Prefect).
    """
    from pettingflow.runs.replay import plan_replay
    from pettingflow.runs.run import RunRef, check_rerun, format_change

    root = _root_for(run_id, root)
    ref = RunRef(root=root, run_id=run_id)
    try:  # refuse a bad request (iteration, step, pruned weights, overrides) before any flow run or server starts
        config, changes = check_rerun(ref, iteration, from_step, overrides or [])
    except (ConfigError, FileNotFoundError, ValueError) as exc:  # RerunRequestError, RerunOverrideError: ValueError
        fail(str(exc))
    typer.echo(plan_replay(ref.layout(), config, iteration, changes).line)  # exact replay, or why not
    from pettingflow.flows.rerun import rerun as rerun_flow  # Prefect's import: only for a request that will run

    for change in changes:
        typer.echo(f"  {format_change(change)}")
    if os.environ.get("PREFECT_API_URL") is None:
        typer.secho("PREFECT_API_URL is not set: running with a temporary local Prefect server", err=True)
    result = rerun_flow(
        run_id=run_id,
        iteration=iteration,
        from_step=from_step,
        root=root,
        with_validation=validate,
        overrides=overrides or [],
    )
    typer.echo(f"re-ran iteration {iteration} of {run_id} as attempt {result['attempt']}: {result['report']}")


# ------------------------------------------------------------------------------------------ after training
WeightsOpt = Annotated[
    str,
    typer.Option(
        "--weights",
        help="The weights to score or play: base (the config's base models), a run (RUN: its last iteration's "
        "weights; RUN:ITER: after iteration ITER), a model folder, a prepared model name or a Hugging Face id in the "
        "local cache.",
    ),
]


WeightsRootOpt = Annotated[
    str,
    typer.Option(
        "--root",
        help="Storage root of a run named by --weights or --compare (default: the config's run.storage_root, else "
        "where this machine's run index says the run is). The evaluation run is written under run.storage_root.",
    ),
]


def _weights(spec: str, root: str, cfg: ExperimentConfig) -> Weights:
    """``runs.evaluation.parse_weights`` with a run looked for under ``--root``, else the config's
    ``run.storage_root``, else where this machine's run index says it is."""
    from pettingflow.runs.evaluation import WeightsError, parse_weights, run_exists
    from pettingflow.storage.run_index import find_run

    run_id = spec.partition(":")[0]
    where = root or cfg.run.storage_root
    if not root and not run_exists(run_id, where, cfg.run.storage_options):
        entry = find_run(run_id)
        where = entry["root"] if entry else where
    try:
        return parse_weights(spec, where, cfg.run.storage_options)
    except WeightsError as exc:
        fail(str(exc))


def _eval_overrides(tasks: str, samples: int | None, temperature: float | None) -> list[str]:
    """The options of ``eval`` and ``play`` as config overrides (so the evaluation run's config records them)."""
    out = ["env.dataset.source=file", f"env.dataset.path={tasks}"] if tasks else []
    out += [f"validation.samples_per_task={samples}"] if samples is not None else []
    return out + ([f"validation.temperature={temperature}"] if temperature is not None else [])


@app.command("eval")
def eval_weights(
    config: Annotated[str, typer.Argument(help="Config name or YAML path: the tasks, seeds and servers to use.")],
    weights: WeightsOpt,
    overrides: Overrides = None,
    compare: Annotated[
        str,
        typer.Option(
            "--compare",
            help="Also score these weights (same forms as --weights) on the same tasks "
            "and seeds, and print the difference paired by task.",
        ),
    ] = "",
    tasks: Annotated[
        str, typer.Option("--tasks", help="A task file to score on (sets env.dataset.source=file, env.dataset.path).")
    ] = "",
    split: Annotated[
        str,
        typer.Option("--split", help="validation (held-out), train or all (default: validation; with --tasks, all)."),
    ] = "",
    num_tasks: Annotated[
        int | None,
        typer.Option(
            "--num-tasks",
            min=0,
            help="First N tasks of the split (default: validation.num_tasks; with --tasks, every task); 0: all.",
        ),
    ] = None,
    samples: Annotated[
        int | None, typer.Option("--samples", min=1, help="Episodes per task (validation.samples_per_task).")
    ] = None,
    temperature: Annotated[
        float | None, typer.Option("--temperature", min=0.0, help="Sampling temperature (validation.temperature).")
    ] = None,
    root: WeightsRootOpt = "",
) -> None:
    """Score weights on a task set: per-agent success with a 95 % interval, stored as an evaluation run (listed by
    `runs list`) through the validation step the train flow uses; with --compare, both on the same tasks and seeds
    and the paired difference by task. Starts the config's servers (or attaches to inference.url)."""
    from pettingflow.inference.models import ModelError
    from pettingflow.runs.evaluation import (
        WeightsError,
        compare_evaluations,
        comparison_lines,
        evaluate_weights,
        read_scores,
        score_lines,
        select_tasks,
        write_report,
    )

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    extra = _eval_overrides(tasks, samples, temperature)
    all_overrides = [*(overrides or []), *extra]
    cfg = _config(config, all_overrides)
    sides = [_weights(weights, root, cfg)] + ([_weights(compare, root, cfg)] if compare else [])
    split = split or ("all" if tasks else "validation")
    try:
        chosen = select_tasks(cfg, split, 0 if tasks and num_tasks is None else num_tasks)
    except (WeightsError, ValueError) as exc:  # TaskFileError: ValueError
        fail(f"{config}: {exc}")
    record = {"split": split, **({"tasks_file": tasks} if tasks else {})}
    try:
        done = evaluate_weights(cfg, config, all_overrides, sides, tasks=chosen, extra=record)
    except (WeightsError, ConfigError, ModelError) as exc:  # e.g. a model the servers cannot load
        fail(str(exc))
    scores = [read_scores(d.ref.layout()) for d in done]
    for line in score_lines(scores[0]):
        typer.echo(line)
    comparison = None
    if compare:
        try:
            comparison = compare_evaluations(scores[0], scores[1])
        except WeightsError as exc:
            fail(str(exc))
        for line in score_lines(scores[1]):
            typer.echo(line)
        for line in comparison_lines(comparison, scores[0], scores[1]):
            typer.echo(line)
        write_report(done[1].ref.layout(), scores[1])
    uri = write_report(done[0].ref.layout(), scores[0], comparison, scores[1] if compare else None)
    typer.echo(f"written to {uri} (and evaluation.json beside it)")


@app.command("export")
def export(
    run_id: Annotated[str, typer.Argument(help="A run id (see `pettingflow runs list`).")],
    out: Annotated[str, typer.Option("--out", help="A new (or empty) folder to write the export into.")],
    iteration: Annotated[
        int | None,
        typer.Option("--iteration", "-k", help="Export the weights after this iteration (default: the last)."),
    ] = None,
    merge_lora: Annotated[
        bool, typer.Option("--merge-lora", help="LoRA: write each agent's adapter merged into the base (a full model).")
    ] = False,
    root: RootOpt = "",
) -> None:
    """Export a run's trained team: one Hugging Face folder per policy (LoRA: per agent) with its tokenizer,
    generation config and a model card (base model, config, tasks, iterations, tokens, held-out before -> after),
    and team.json (which folder plays which agent)."""
    from pettingflow.runs.export import ExportError, export_run

    layout = _existing_run(run_id, root)
    try:
        done = export_run(layout, out, iteration, merge_lora)
    except ExportError as exc:
        fail(str(exc))
    typer.echo(f"exported {run_id} after iteration {done.iteration} to {done.out}:")
    for entry in done.folders:
        typer.echo(f"  {entry.folder}/: {entry.holds} of policy {entry.policy}, playing {', '.join(entry.agents)}")
    typer.echo(f"load one: transformers.AutoModelForCausalLM.from_pretrained('{done.out}/{done.folders[0].folder}')")


@app.command("play")
def play(
    config: Annotated[str, typer.Argument(help="Config name or YAML path: the team, its env and servers.")],
    weights: WeightsOpt,
    overrides: Overrides = None,
    task: Annotated[str, typer.Option("--task", help="A task id of the config's dataset (held-out or train).")] = "",
    task_json: Annotated[
        str, typer.Option("--task-json", help="A task as one JSON object, as a line of a task file (docs/datasets.md).")
    ] = "",
    temperature: Annotated[
        float | None, typer.Option("--temperature", min=0.0, help="Sampling temperature (validation.temperature).")
    ] = None,
    prompts: Annotated[bool, typer.Option("--prompts/--no-prompts", help="Print each turn's prompt.")] = True,
    root: WeightsRootOpt = "",
) -> None:
    """Play one episode of the team on one task and print it turn by turn (as `trajectories episode` prints stored
    ones: rewards, the sandbox's verdicts, prompts and responses); stored as an evaluation run the viewer shows."""
    from pettingflow.inference.models import ModelError
    from pettingflow.runs.evaluation import WeightsError
    from pettingflow.runs.play import TaskError, find_task, task_from_json
    from pettingflow.runs.play import play as play_episode

    if bool(task) == bool(task_json):
        fail("name one task: --task ID (of the config's dataset) or --task-json '{...}'")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    all_overrides = [*(overrides or []), *_eval_overrides("", None, temperature)]
    cfg = _config(config, all_overrides)
    side = _weights(weights, root, cfg)
    try:
        chosen = find_task(cfg, task) if task else task_from_json(cfg, task_json)
        _, lines = play_episode(cfg, config, all_overrides, side, chosen, prompts)
    except (TaskError, WeightsError, ConfigError, ModelError) as exc:
        fail(str(exc))
    typer.echo("\n".join(lines))


def main() -> None:  # pragma: no cover - console-script convenience
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
