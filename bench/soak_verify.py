"""Is every committed iteration of a run intact, and its weights lineage unbroken? (``python -m bench.soak --verify``;
``verify_run`` for any run folder.)

Written for the soak's kill mode: after SIGKILLs of the flow run, a learner rank, the vLLM
server and the Prefect worker or server, and resumes, nothing committed may be lost or duplicated. For every
iteration whose report is committed (attempt 0):

- every committed step's files are there with the size and sha256 its marker lists (a pruned checkpoint is no
  longer listed: its marker says what retention removed);
- the rollouts hold rows, as many as their marker says, of this run and iteration; each (env_idx, sample_idx,
  turn_idx, agent_idx) once; every group has its ``env.group_size`` samples; each row's UID is the one
  ``rl/uids.assign_uids`` gives its (rollout_idx // group_size, turn_idx, agent_idx) under the namespace
  ``<run_id>/<iteration>`` (what the rollout wrote: recomputed from the stored rows alone);
- the filtered and advantages steps are committed, the advantages batch of each policy holds rows;
- the report's metrics hold the phase times and each policy's update metrics, finite;
- lineage (``runs/lineage.py``): each policy's update either did work or says it was skipped; an update that did
  work started from the weights the newest earlier update produced (its marker's ``starts_from``), or from the base
  model when there is none; the rows it trained on are within the run's lag bound of those weights; and the newest
  update's weights are still there (a resume can train from them).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from pathlib import Path
from typing import Any

from pettingflow.storage import RunLayout, Step
from pettingflow.storage.layout import StepName

#: metrics every report must hold (``{p}``: each policy)
REQUIRED_METRICS = (
    f"duration/{StepName.ROLLOUTS}_s",
    "duration/{update}_s",
    "update/{p}/loss",
    "update/{p}/grad_norm",
)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def step_files(step: Step) -> list[str]:
    """Problems with a committed step's files: missing, another size, another sha256 than its marker lists."""
    problems = []
    for entry in step.manifest().files:
        path = Path(step.path) / entry.name
        if not path.is_file():
            problems.append(f"{step.uri}: {entry.name} listed in the marker is missing")
        elif path.stat().st_size != entry.bytes:
            problems.append(f"{step.uri}: {entry.name} has {path.stat().st_size} bytes, the marker {entry.bytes}")
        elif sha256_file(path) != entry.sha256:
            problems.append(f"{step.uri}: {entry.name} does not match its marker's sha256")
    return problems


def committed_steps(layout: RunLayout, k: int) -> list[Step]:
    root = Path(layout.iteration_path(k))
    return [
        layout.step(k, p.name) for p in sorted(root.iterdir()) if p.is_dir() and layout.step(k, p.name).is_committed()
    ]


def rollout_rows(layout: RunLayout, k: int, group_size: int) -> tuple[list[str], Any]:
    """Problems with iteration ``k``'s rollouts, and the table (None when unreadable)."""
    from pettingflow.rl.uids import assign_uids
    from pettingflow.storage.trajectories import read_step_trajectories

    step = layout.step(k, StepName.ROLLOUTS)
    where = f"iter-{k}/{StepName.ROLLOUTS}"
    if not step.is_committed():
        return [f"{where}: not committed"], None
    try:
        table = read_step_trajectories(step, verify=False)  # the files were checked against the marker already
    except Exception as exc:  # any unreadable file is the finding
        return [f"{where}: unreadable: {exc}"], None
    problems = []
    rows = table.to_pydict()
    n = table.num_rows
    if n == 0:
        problems.append(f"{where}: no rows")
    if n != step.manifest().rows:
        problems.append(f"{where}: {n} rows, its marker says {step.manifest().rows}")
    if set(rows["run_id"]) - {layout.run_id} or set(rows["iteration"]) - {k}:
        problems.append(f"{where}: rows of another run or iteration: {set(rows['run_id'])} {set(rows['iteration'])}")
    keys = Counter(zip(rows["env_idx"], rows["sample_idx"], rows["turn_idx"], rows["agent_idx"], strict=True))
    twice = [key for key, count in keys.items() if count > 1]
    if twice:
        problems.append(
            f"{where}: {len(twice)} (env_idx, sample_idx, turn_idx, agent_idx) stored twice, e.g. {twice[0]}"
        )
    samples: dict[int, set[int]] = {}
    for env, sample in zip(rows["env_idx"], rows["sample_idx"], strict=True):
        samples.setdefault(env, set()).add(sample)
    short = {env: sorted(s) for env, s in samples.items() if s != set(range(group_size))}
    if short:
        problems.append(f"{where}: groups without their {group_size} samples (env_idx: samples): {short}")
    if n:
        expected = assign_uids(
            rows["rollout_idx"], rows["turn_idx"], rows["agent_idx"], group_size, f"{layout.run_id}/{k}"
        )
        wrong = sum(a != b for a, b in zip(rows["uid"], expected, strict=True))
        if wrong:
            problems.append(f"{where}: {wrong} of {n} rows carry another UID than their (group, turn, agent) gives")
    return problems, table


def lineage(layout: RunLayout, config: Any, k: int, table: Any) -> list[str]:
    """Problems with the weights iteration ``k``'s updates started from and the rows they trained on."""
    from pettingflow.runs.lineage import allowed_policy_lag, start_version
    from pettingflow.training.checkpoint import BASE_WEIGHTS

    problems = []
    bound = allowed_policy_lag(config)
    for policy in [p.name for p in config.policies]:
        update = layout.step(k, StepName.UPDATE.folder(policy))
        where = f"iter-{k}/{update.name}"
        if not update.is_committed():
            problems.append(f"{where}: not committed")
            continue
        meta = update.manifest().metadata
        if meta.get("skipped"):
            continue
        version = start_version(layout, policy, k)
        expected = layout.step(version - 1, StepName.UPDATE.folder(policy)).uri if version else BASE_WEIGHTS
        if str(meta.get("starts_from")) != str(expected):
            problems.append(f"{where}: started from {meta.get('starts_from')}, the lineage says {expected}")
        if table is not None:
            versions = [
                v
                for v, p in zip(table["policy_version"].to_pylist(), table["policy_name"].to_pylist(), strict=True)
                if p == policy
            ]
            lags = {version - v for v in versions}
            if versions and (max(lags) > bound or min(lags) < 0):
                problems.append(
                    f"{where}: rows of weights versions {sorted(set(versions))}, the update starts from {version} "
                    f"(lag bound {bound})"
                )
    return problems


def report_metrics(layout: RunLayout, config: Any, k: int) -> list[str]:
    from pettingflow.steps.report import read_metrics

    metrics = read_metrics(layout.step(k, StepName.REPORT))
    problems = []
    for policy in [p.name for p in config.policies]:
        if layout.step(k, StepName.UPDATE.folder(policy)).is_committed() and layout.step(
            k, StepName.UPDATE.folder(policy)
        ).manifest().metadata.get("skipped"):
            continue
        for name in (m.format(p=policy, update=StepName.UPDATE.folder(policy)) for m in REQUIRED_METRICS):
            value = metrics.get(name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                problems.append(f"iter-{k}/report: metric {name} is {value!r}")
    return problems


def newest_weights(layout: RunLayout, config: Any, last: int) -> list[str]:
    """The weights a resume trains from (the newest update that did work, per policy) are still there."""
    from pettingflow.runs.lineage import PrunedWeightsError, weights_before

    problems = []
    for policy in [p.name for p in config.policies]:
        try:
            weights = weights_before(layout, config, policy, last + 1)
        except PrunedWeightsError as exc:
            problems.append(f"a resume after iteration {last} cannot start: {exc}")
            continue
        if not Path(weights.model_dir).is_dir():
            problems.append(f"{policy}: the newest weights {weights.model_dir} are not there")
    return problems


def verify_run(layout: RunLayout, files: bool = True) -> tuple[list[int], list[str]]:
    """(the iterations checked: those whose report is committed, the problems found); no problems: intact."""
    from pettingflow.configs.settings import ExperimentConfig

    config = ExperimentConfig.model_validate(layout.read_run_info()["config"])
    checked, problems = [], []
    for k in layout.iterations():
        if not layout.step(k, StepName.REPORT).is_committed():
            continue
        checked.append(k)
        if files:
            for step in committed_steps(layout, k):
                problems += step_files(step)
        found, table = rollout_rows(layout, k, config.env.group_size)
        problems += found
        for name in (StepName.FILTERED, StepName.ADVANTAGES):
            if not layout.step(k, name).is_committed():
                problems.append(f"iter-{k}/{name}: not committed")
        problems += report_metrics(layout, config, k)
        problems += lineage(layout, config, k, table)
    if checked != list(range(len(checked))):
        problems.append(f"committed reports are not iterations 0..{len(checked) - 1}: {checked}")
    if checked:
        problems += newest_weights(layout, config, checked[-1])
    return checked, problems


def verify_soak(out: Path) -> int:
    """Verify the soak's run; prints one line per problem, exit code 1 when there is any."""
    import json

    meta = json.loads((out / "soak.json").read_text())
    layout = RunLayout(str(out / "outputs"), meta["run_id"])
    checked, problems = verify_run(layout)
    for problem in problems:
        print(f"PROBLEM {problem}")
    kills = (out / "kills.jsonl").read_text().splitlines() if (out / "kills.jsonl").exists() else []
    print(
        f"{layout.run_id}: {len(checked)} committed iterations checked ({len(kills)} kills along the way): "
        + ("intact, lineage unbroken" if not problems else f"{len(problems)} problem(s)")
    )
    return 1 if problems else 0
