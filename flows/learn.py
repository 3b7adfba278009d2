"""The ``learn`` flow: does training help? Held-out scores before and after, for several configs side by side.

For each config (default: the code agent alone, then the two-agent team, on the same tasks, seeds and
budget) it runs three subflows against one shared vLLM server:

1. ``evaluate`` on the base model (the held-out split; sampled as the config says, and greedy), once per study
   for configs that score the base model identically (``base_evaluation_key``: e.g. a tree arm and an
   independent arm of one team), so arms compared at one seed share one "before",
2. ``train`` for ``run.iterations`` iterations (the same flow ``prefect deployment run train/...`` runs),
3. ``evaluate`` on the weights after the last iteration (the same two views, the same seeds), and, for a team
   whose two agents have weights of their own (LoRA adapters or two policies), once more with the roles
   swapped (view ``swapped``: each agent played by the other's weights, the study's positive control),

then writes ``learning.json`` (every number), ``learning.png`` (curves) and ``learning.md`` (the table)
under ``<storage_root>/learning/<stamp>/``. One server for everything saves a 1–2 minute vLLM start per
subflow on CPU; the flow puts the base weights back on it before each config, and each subflow syncs
what it needs (the trained weights for the final evaluation). An arm of several full models (L3, one model per
agent: ``own_servers``) cannot share one server; its subflows start a server per policy of their own.

    make learn                                    # both configs, full budget (an hour or more on a small CPU)
    .venv/bin/python flows/learn.py --configs code-env-learn --overrides run.iterations=2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Callable
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from pettingflow.analysis.learning import (
    ArmResult,
    arm_from_runs,
    results_table,
    write_learning_report,
)
from pettingflow.configs.loader import load_config
from pettingflow.flows.evaluate import evaluate, roles_swappable
from pettingflow.flows.train import train
from pettingflow.inference.models import resolve_model
from pettingflow.runs.retention import plan_prune, prune
from pettingflow.runs.runtime import shared_service
from pettingflow.storage import RunLayout

DEFAULT_CONFIGS = ("code-env-learn-solo", "code-env-learn")

#: Two views of the held-out score. ``sampled``: the config's own validation settings (for the learn
#: configs: 4 samples per task at temperature 1, i.e. pass@1 of the policy that was trained). ``greedy``:
#: one temperature-0 answer per task, what a user of the model would usually see.
EVAL_VIEWS: dict[str, list[str]] = {
    "sampled": [],
    "greedy": ["validation.temperature=0", "validation.samples_per_task=1"],
}


def _shared_model(names: list[str], overrides: list[str]) -> tuple[Path, list[Any]]:
    """The one base model all configs must share (one server serves them all), and the loaded configs."""
    configs = [load_config(n, overrides) for n in names]
    models = {resolve_model(p.model) for c in configs for p in c.policies}
    if len(models) != 1:
        raise ValueError(
            "learn runs every config on one shared server, so they must all use one base model; "
            f"got {sorted(map(str, models))}"
        )
    return models.pop(), configs


def own_servers(config: Any) -> bool:
    """Whether an arm needs inference servers of its own: several full models (L3) need one server per policy,
    which the one shared server (one model whose weights are swapped in place) cannot be. Such an arm's ``train``
    and ``evaluate`` subflows start and stop their own servers, a vLLM start each (1-2 minutes on CPU)."""
    return config.specialization.value == "full" and len(config.policies) > 1


#: What a base evaluation does not depend on: how a config trains. Validation runs independent episodes of the base
#: weights on the held-out split with seeds from run.seed, so two configs equal but for these keys score the base
#: model identically and ``learn`` evaluates it once. Everything else (agents, env, validation, inference, the
#: rollout's concurrency, which shapes the server's batches) stays in the key.
TRAINING_ONLY: dict[str, tuple[str, ...] | None] = {
    "run": ("name", "iterations", "max_generated_tokens", "mlflow_tracking_uri"),
    "rollout": ("mode", "tree_select", "tree", "async_rollouts", "max_policy_lag"),
    "env": ("group_size", "tasks_per_iteration"),
    "algorithm": None,  # the whole section
    "training": None,
}


def base_evaluation_key(config: Any) -> str:
    """A digest of what ``config``'s base evaluation depends on (``TRAINING_ONLY`` left out)."""
    data = config.model_dump(mode="json")
    for section, keys in TRAINING_ONLY.items():
        if keys is None:
            data.pop(section, None)
        else:
            for key in keys:
                data.get(section, {}).pop(key, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def base_evaluations(
    name: str,
    overrides: list[str],
    done: dict[str, tuple[str, dict[str, Any]]],
    evaluate_fn: Callable[..., dict[str, Any]] = evaluate,
) -> tuple[dict[str, Any], str | None]:
    """The base model's held-out scores for config ``name`` (every view of ``EVAL_VIEWS``), and the config whose
    identical evaluation was reused (None: evaluated now). ``done``: key -> (config, evaluations), filled here."""
    key = base_evaluation_key(load_config(name, overrides))
    if key in done:
        return done[key][1], done[key][0]
    before = {view: evaluate_fn(name, [*overrides, *extra]) for view, extra in EVAL_VIEWS.items()}
    done[key] = (name, before)
    return before, None


def _scores(evaluations: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """view -> agent -> metrics, from ``evaluate`` results (for the log)."""
    return {view: result["agents"] for view, result in evaluations.items()}


def _run_ids(evaluations: dict[str, dict[str, Any]]) -> dict[str, str]:
    """view -> the ``evaluate`` run that holds its trajectories."""
    return {view: result["run_id"] for view, result in evaluations.items()}


def _run_arm(
    name: str,
    label: str,
    run_overrides: list[str],
    cfg: Any,
    shared: Any | None,
    base_done: dict[str, tuple[str, dict[str, Any]]],
) -> ArmResult:
    """One arm of a study: the base model scored (or reused), trained, scored again (and role-swapped where the
    agents have weights of their own). ``shared``: the server the arm attaches to (None: it starts its own)."""
    logger = get_run_logger()
    started = time.perf_counter()
    if shared is not None:
        shared.serve_base()  # whatever an earlier config left on the server
    logger.info("%s: the base model on the held-out split", label)
    before, reused = base_evaluations(name, run_overrides, base_done)
    if reused:
        logger.info("%s: the base model scores as for %s (same agents, env, validation, seed)", label, reused)
    logger.info("%s: held-out before training: %s", label, _scores(before))
    trained = train(name, run_overrides)
    after = {
        view: evaluate(name, [*run_overrides, *extra], run_id=trained["run_id"]) for view, extra in EVAL_VIEWS.items()
    }
    if roles_swappable(cfg):  # the positive control: trained roles, swapped
        after["swapped"] = evaluate(name, run_overrides, run_id=trained["run_id"], roles_swapped=True)
    logger.info("%s: held-out after training: %s", label, _scores(after))
    ids = {"before": _run_ids(before), "after": _run_ids(after)}
    arm = arm_from_runs(cfg.run.storage_root, trained["run_id"], cfg.run.storage_options, evaluations=ids)
    arm.wall_s = round(time.perf_counter() - started, 1)
    return arm


@flow(name="learn", log_prints=True)
def learn(
    configs: list[str] | None = None,
    overrides: list[str] | None = None,
    url: str | None = None,
    seeds: list[int] | None = None,
    prune_checkpoints: bool = False,
) -> dict[str, Any]:
    """Evaluate, train and re-evaluate each config; return the results table and where the files are.

    ``url``: use this running server (started with vLLM's dev mode, so weights can be reloaded)
    instead of starting one. ``seeds``: train every config once per seed (``run.seed=<s>``, which also
    seeds the evaluations), so the report can pair arms seed by seed; default: the configs' own seed.
    ``prune_checkpoints``: once an arm is scored, drop its checkpoints except the last update's
    (``pettingflow runs prune``): the report needs only trajectories, and a many-arm comparison otherwise
    keeps ≈1 GB per iteration at 135M. Its iterations can then no longer be re-run.
    The report is written after every arm (a study stopped midway keeps what it scored); an arm that fails is
    logged and skipped, the report lists it under ``failed``, and the flow fails at the end, naming it.
    """
    logger = get_run_logger()
    names = list(configs or DEFAULT_CONFIGS)
    overrides = list(overrides or [])
    model, loaded = _shared_model(names, overrides)
    configs_by_name, first = dict(zip(names, loaded, strict=True)), loaded[0]
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out_uri = f"{first.run.storage_root.rstrip('/')}/learning/{stamp}"
    sharing = [c for c in loaded if not own_servers(c)]
    if url and len(sharing) < len(loaded):
        raise ValueError(
            f"--url attaches every arm to one server, but {[n for n, c in configs_by_name.items() if own_servers(c)]} "
            "have several full models (specialization full), one server per policy: run those without --url"
        )
    lora = any(c.specialization.value == "lora" for c in loaded)  # the shared server serves adapters if any arm has
    shared = shared_service(model, sharing[0], url, f"learn-{stamp}", enable_lora=lora) if sharing else None
    arms: list[ArmResult] = []
    base_done: dict[str, tuple[str, dict[str, Any]]] = {}
    if shared is not None and not url:
        logger.info("starting one vLLM server for %s (1-2 minutes on CPU; log %s)", model, shared.server.log_path)
    failed: list[str] = []
    report_extra = {"configs": names, "overrides": overrides, "seeds": seeds}
    with shared.server if shared is not None else nullcontext():
        attach = overrides
        if shared is not None:
            logger.info("inference server ready at %s", shared.server.url)
            attach = [*overrides, f"inference.url={shared.server.url}"]
        for seed, name in [(s, n) for s in (seeds or [None]) for n in names]:
            label = name if seed is None else f"{name} (seed {seed})"
            cfg = configs_by_name[name]
            arm_shared = None if own_servers(cfg) else shared
            run_overrides = overrides if arm_shared is None else attach
            if seed is not None:
                run_overrides = [*run_overrides, f"run.seed={seed}"]
            try:
                arm = _run_arm(name, label, run_overrides, cfg, arm_shared, base_done)
            except Exception as exc:  # one arm's failure must not cost the arms already scored their report
                logger.exception("%s failed; the study goes on with the next arm", label)
                failed.append(f"{label}: {type(exc).__name__}: {exc}")
                arm = None
            if arm is not None:
                arms.append(arm)
            # the report so far, after every arm: a study stopped midway (a session's end) keeps what it scored
            table = write_learning_report(arms, out_uri, first.run.storage_options, **report_extra, failed=failed)
            if arm is not None and prune_checkpoints:
                layout = RunLayout(cfg.run.storage_root, arm.run_id, cfg.run.storage_options)
                freed = prune(plan_prune(layout, keep_last=1))
                logger.info("%s: pruned %.2f GB of checkpoints (the last update's kept)", label, freed / 1e9)
    print(table)
    logger.info("learning results in %s", out_uri)
    if failed:
        raise RuntimeError(
            f"{len(failed)} of {len(failed) + len(arms)} arms failed (the report in {out_uri} holds the others; "
            "rerun the failed ones with --configs/--seeds and combine with `pettingflow runs learning-report "
            "--from-json`):\n" + "\n".join(failed)
        )
    return {"uri": out_uri, "rows": results_table(arms)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), help="configs to compare")
    parser.add_argument("--overrides", nargs="*", default=[], help="overrides for every config, e.g. run.iterations=2")
    parser.add_argument("--url", default=None, help="attach to a running dev-mode vLLM server instead of starting one")
    parser.add_argument("--seeds", nargs="*", type=int, default=None, help="train each config once per seed")
    parser.add_argument(
        "--prune-checkpoints",
        action="store_true",
        help="after scoring each arm, drop its checkpoints but the last (saves ~1 GB per iteration at 135M)",
    )
    args = parser.parse_args(argv)
    learn(args.configs, args.overrides, args.url, args.seeds, args.prune_checkpoints)


if __name__ == "__main__":
    main()
