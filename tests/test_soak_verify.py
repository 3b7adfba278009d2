"""bench/soak_verify.py: the check that a run killed along the way lost nothing.

A small run is written with the project's own storage (two iterations: rollouts with the UIDs the rollout gives,
filtered, advantages, an update per iteration whose marker says which weights it started from, a report): intact,
it passes; each planted fault (a row missing, a row stored twice, a wrong UID, a file changed after its commit, a
metric missing, an update that started from the wrong weights, the newest weights pruned away) is named.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from factories import trajectory_row

from bench.soak_verify import verify_run
from pettingflow.configs.loader import load_config
from pettingflow.rl.uids import assign_uids
from pettingflow.storage import RunLayout
from pettingflow.storage.layout import StepName
from pettingflow.storage.trajectories import write_trajectories
from pettingflow.training.checkpoint import BASE_WEIGHTS

RUN = "soak-test"
GROUP = 2


def rows_of(k: int) -> list[dict]:
    """Two tasks x GROUP samples x one turn of one agent, with the UIDs the rollout assigns."""
    rows = []
    for env in range(2):
        for sample in range(GROUP):
            rollout = env * GROUP + sample
            rows.append(
                trajectory_row(
                    run_id=RUN, iteration=k, env_idx=env, sample_idx=sample, rollout_idx=rollout, group_id=f"g{env}",
                    agent_idx=0, turn_idx=0, policy_name="shared", policy_version=k, reward=float(sample),
                )
            )  # fmt: skip
    uids = assign_uids([r["rollout_idx"] for r in rows], [0] * len(rows), [0] * len(rows), GROUP, f"{RUN}/{k}")
    for row, uid in zip(rows, uids, strict=True):
        row["uid"] = uid
    return rows


def make_run(root: Path, iterations: int = 2, rows=rows_of) -> RunLayout:
    model = root / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    config = load_config("code-env", [f"policies.0.model={model}", f"env.group_size={GROUP}"])
    layout = RunLayout(str(root / "outputs"), RUN)
    layout.write_run_info({"run_id": RUN, "config": config.model_dump(mode="json")})
    for k in range(iterations):
        write_trajectories(layout.step(k, StepName.ROLLOUTS), rows(k))
        for name in (StepName.FILTERED, StepName.ADVANTAGES):
            step = layout.step(k, name).begin()
            step.write_json("batch.json", {"rows": 4})
            step.commit()
        update = layout.step(k, StepName.UPDATE.folder("shared")).begin()
        update.write_bytes("model/model.safetensors", f"weights after {k}".encode())
        starts = layout.step(k - 1, StepName.UPDATE.folder("shared")).uri if k else BASE_WEIGHTS
        update.commit({"starts_from": starts, "skipped": False, "metrics": {"loss": 0.1}})
        report = layout.step(k, StepName.REPORT).begin()
        metrics = {"duration/rollouts_s": 3.0, "duration/update-shared_s": 5.0, "update/shared/loss": 0.1}
        report.write_json("metrics.json", {**metrics, "update/shared/grad_norm": 1.0})
        report.commit()
    return layout


def problems(layout: RunLayout) -> list[str]:
    checked, found = verify_run(layout)
    assert checked == [0, 1]
    return found


def test_an_intact_run_passes(tmp_path: Path) -> None:
    assert problems(make_run(tmp_path)) == []


@pytest.mark.parametrize(
    ("fault", "named"),
    [
        ("missing_row", "groups without their 2 samples"),
        ("twice", "stored twice"),
        ("wrong_uid", "another UID"),
    ],
)
def test_planted_row_faults_are_named(tmp_path: Path, fault: str, named: str) -> None:
    def rows(k: int) -> list[dict]:
        out = rows_of(k)
        if k == 1 and fault == "missing_row":
            out.pop()
        elif k == 1 and fault == "twice":
            out.append(dict(out[0]))
        elif k == 1 and fault == "wrong_uid":
            out[0]["uid"] = out[-1]["uid"]  # another group's UID
        return out

    found = problems(make_run(tmp_path, rows=rows))
    assert any(named in p and "iter-1/rollouts" in p for p in found), found


def test_a_file_changed_after_its_commit_is_named(tmp_path: Path) -> None:
    layout = make_run(tmp_path)
    path = Path(layout.step(0, StepName.ADVANTAGES).path) / "batch.json"
    path.write_text(path.read_text().replace("4", "5"))  # same size, other bytes
    assert any("batch.json does not match its marker's sha256" in p for p in problems(layout))


def test_a_missing_metric_is_named(tmp_path: Path) -> None:
    layout = make_run(tmp_path)
    report = layout.step(1, StepName.REPORT)
    metrics = report.read_json("metrics.json")
    del metrics["update/shared/grad_norm"]
    report.fs.rm(report.path, recursive=True)
    report.begin().write_json("metrics.json", metrics)
    report.commit()
    assert problems(layout) == ["iter-1/report: metric update/shared/grad_norm is None"]


def test_a_broken_lineage_is_named(tmp_path: Path) -> None:
    layout = make_run(tmp_path)
    update = layout.step(1, StepName.UPDATE.folder("shared"))
    manifest = update.manifest()
    manifest.metadata["starts_from"] = BASE_WEIGHTS  # iteration 1 trained from the base model, not update 0's
    Path(update.marker_path).write_text(manifest.to_json())
    found = problems(layout)
    assert len(found) == 1 and "iter-1/update-shared: started from base" in found[0], found


def test_rows_of_the_wrong_weights_are_named(tmp_path: Path) -> None:
    def rows(k: int) -> list[dict]:
        return [{**r, "policy_version": 0} for r in rows_of(k)]  # iteration 1 sampled by the base weights

    found = problems(make_run(tmp_path, rows=rows))
    assert any("iter-1/update-shared: rows of weights versions [0], the update starts from 1" in p for p in found)


def test_pruned_newest_weights_are_named(tmp_path: Path) -> None:
    layout = make_run(tmp_path)
    layout.step(1, StepName.UPDATE.folder("shared")).prune(("model/",), {"by": "a test"})
    assert any("a resume after iteration 1 cannot start" in p for p in problems(layout))
