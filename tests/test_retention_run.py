"""The run's own retention (the ``disk`` settings, ``runs/retention.apply_retention``): which weights and optimizer
snapshots it keeps, that a long run's checkpoints stay bounded, that what it removed fails naming it, and that a kill
in the middle of a pass (``prune:mid``) leaves a run that resumes and a next pass that ends where an uninterrupted
one would have."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pettingflow import faults
from pettingflow.configs.loader import load_config
from pettingflow.configs.settings import ExperimentConfig
from pettingflow.runs.lineage import PrunedWeightsError, weights_before
from pettingflow.runs.retention import RETENTION_BY, apply_retention, kept_snapshots, kept_weights, plan_retention
from pettingflow.storage import RunLayout
from pettingflow.storage.commits import MARKER

WEIGHTS = b"w" * 1000  # model/ of an update
SNAPSHOT = b"s" * 7000  # deepspeed/ of its snapshot (about 7x the weights, as at 135M)


def config_for(base: Path, *overrides: str) -> ExperimentConfig:
    return load_config("code-env", [f"policies.0.model={base}", "run.iterations=100", *overrides])


@pytest.fixture
def base(tmp_path: Path) -> Path:
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def commit_iteration(layout: RunLayout, k: int, *, snapshot: bool = True, inline: bool = False) -> None:
    """What iteration k of a run commits for policy ``shared``: its update (weights, metrics) and, written after
    it in the background, its optimizer snapshot (or inside the update with ``inline``)."""
    update = layout.step(k, "update-shared")
    update.begin()
    update.write_bytes("model/model.safetensors", WEIGHTS)
    if snapshot and inline:
        update.write_bytes("deepspeed/state.pt", SNAPSHOT)
    update.write_json("metrics.json", {"loss": float(k)})
    update.commit({"skipped": False})
    if snapshot and not inline:
        step = layout.step(k, "optimizer-shared")
        step.begin()
        step.write_bytes("deepspeed/state.pt", SNAPSHOT)
        step.commit({"policy": "shared"})


def held(layout: RunLayout, upto: int) -> tuple[list[int], list[int]]:
    """The iterations whose weights, and whose snapshot, are on disk (files, not just markers)."""
    weights, snapshots = [], []
    for k in range(upto + 1):
        if (Path(layout.step(k, "update-shared").path) / "model").exists():
            weights.append(k)
        if any(
            (Path(layout.step(k, name).path) / "deepspeed").exists() for name in ("update-shared", "optimizer-shared")
        ):
            snapshots.append(k)
    return weights, snapshots


def checkpoint_bytes(layout: RunLayout) -> int:
    """Bytes of weights and snapshots on disk (markers, metrics and trajectories grow with the run, by KBs)."""
    files = Path(layout.run_path).rglob("*")
    return sum(p.stat().st_size for p in files if p.is_file() and {"model", "deepspeed"} & set(p.parts))


def test_kept_weights_rule() -> None:
    # the newest 2, and the weights the last 2 iterations start from (their re-runs): updates 7, 8 and 9 at the end of 9
    assert kept_weights(list(range(10)), current=9, keep_last=2, keep_every=0, replay=2) == {7, 8, 9}
    assert kept_weights(list(range(10)), current=9, keep_last=1, keep_every=0, replay=0) == {9}
    assert kept_weights(list(range(10)), current=9, keep_last=1, keep_every=4, replay=0) == {3, 7, 9}
    # skipped updates (no weights): a re-run of iteration 8 or 9 starts from update 5, the newest before them
    assert kept_weights([0, 5], current=9, keep_last=1, keep_every=0, replay=2) == {5}
    assert kept_weights([0, 1, 5], current=6, keep_last=1, keep_every=0, replay=2) == {1, 5}


def test_kept_snapshots_rule() -> None:
    assert kept_snapshots(list(range(10)), current=9, keep=1, replay=2) == {7, 8, 9}
    assert kept_snapshots([3, 7], current=9, keep=1, replay=0) == {7}  # save_optimizer_every's: only the newest
    assert kept_snapshots([3, 7], current=9, keep=2, replay=0) == {3, 7}
    with pytest.raises(ValueError, match="keep_snapshots must be >= 1"):
        kept_snapshots([3], current=3, keep=0, replay=0)


def test_a_long_run_keeps_its_checkpoints_bounded(tmp_path: Path, base: Path) -> None:
    """20 iterations at the defaults (keep_last_updates 2, replay_snapshots 2, keep_snapshots 1): from iteration 2
    on, three updates' weights and three snapshots stay, and the run's checkpoint bytes stop growing."""
    config = config_for(base)
    layout = RunLayout(str(tmp_path / "runs"), "long")
    sizes = []
    for k in range(20):
        commit_iteration(layout, k)
        apply_retention(layout, config, k)
        weights, snapshots = held(layout, k)
        assert weights == snapshots == list(range(max(0, k - 2), k + 1)), k
        sizes.append(checkpoint_bytes(layout))
    assert set(sizes[2:]) == {3 * (len(WEIGHTS) + len(SNAPSHOT))}, sizes
    # the newest weights and snapshot are what a resume starts from; re-runs of iterations 18 and 19 can start
    start = weights_before(layout, config, "shared", 20)
    assert start.model_dir.endswith("iter-19/update-shared/model") and start.optimizer_age == 0
    assert weights_before(layout, config, "shared", 18).deepspeed_dir.endswith("iter-17/optimizer-shared/deepspeed")
    # what was removed says so, and whatever starts from it fails naming the retention
    pruned = layout.step(5, "update-shared").pruned()
    assert pruned[0]["by"] == RETENTION_BY and pruned[0]["prefixes"] == ["model/", "adapters/", "deepspeed/"]
    with pytest.raises(PrunedWeightsError, match=r"after iteration 5 .*removed by disk retention"):
        weights_before(layout, config, "shared", 6)
    assert layout.step(5, "update-shared").read_json("metrics.json") == {"loss": 5.0}  # the rest stays
    assert plan_retention(layout, config, 19) == []  # a second pass finds nothing


def test_periodic_keeps_and_snapshots_of_save_optimizer_every(tmp_path: Path, base: Path) -> None:
    """replay_snapshots 0: only save_optimizer_every's snapshots are written (3, 7, 11), inline; keep_snapshots 1
    keeps the newest; keep_every 5 keeps the weights of 4, 9, 14 (not their snapshots)."""
    config = config_for(
        base, "training.replay_snapshots=0", "disk.keep_last_updates=1", "disk.keep_every=5", "disk.keep_snapshots=1"
    )
    layout = RunLayout(str(tmp_path / "runs"), "periodic")
    for k in range(15):
        commit_iteration(layout, k, snapshot=(k + 1) % 4 == 0, inline=True)
        apply_retention(layout, config, k)
    assert held(layout, 14) == ([4, 9, 14], [11])
    start = weights_before(layout, config, "shared", 15)  # the newest weights with the newest snapshot, 3 updates old
    assert start.model_dir.endswith("iter-14/update-shared/model") and start.optimizer_age == 3


def test_retention_off_keeps_everything(tmp_path: Path, base: Path) -> None:
    config = config_for(base, "disk.keep_last_updates=null", "disk.keep_snapshots=null")
    layout = RunLayout(str(tmp_path / "runs"), "all")
    for k in range(6):
        commit_iteration(layout, k)
        assert apply_retention(layout, config, k) == []
    assert held(layout, 5) == (list(range(6)), list(range(6)))


RETAIN = """
import sys
from pettingflow.configs.loader import load_config
from pettingflow.runs.retention import apply_retention
from pettingflow.storage import RunLayout
root, run_id, base, current = sys.argv[1:]
config = load_config("code-env", [f"policies.0.model={base}", "run.iterations=100"])
apply_retention(RunLayout(root, run_id), config, int(current))
"""


def state_of(layout: RunLayout, upto: int) -> dict[str, object]:
    """Every update and snapshot step: the files its marker lists and the folders on disk."""
    out: dict[str, object] = {}
    for k in range(upto + 1):
        for name in ("update-shared", "optimizer-shared"):
            step = layout.step(k, name)
            folders = sorted(p.name for p in Path(step.path).iterdir() if p.is_dir())
            out[f"{k}/{name}"] = (step.files(), folders)
    return out


def test_a_kill_in_the_middle_of_a_pass_resumes_and_the_next_pass_finishes(tmp_path: Path, base: Path) -> None:
    """Kill matrix point ``prune:mid``: the process dies right after the first step's marker was rewritten (its
    files still there, the other steps untouched). The run still resumes (the weights and snapshot it starts from
    are intact), the leftover folder is unlisted (no reader opens it), and running the pass again, as the resumed
    iteration does, ends in the same state as a pass that was never interrupted."""
    config = config_for(base)
    layout = RunLayout(str(tmp_path / "runs"), "killed")
    for k in range(6):  # no retention yet: iterations 0-2 hold weights and snapshots that must go at the end of 5
        commit_iteration(layout, k)
    reference = RunLayout(str(tmp_path / "reference"), "killed")
    shutil.copytree(layout.run_path, reference.run_path)
    apply_retention(reference, config, 5)

    env = {
        **os.environ,
        faults.ENV_POINTS: "prune:mid",
        faults.ENV_DIR: str(tmp_path / "fired"),
        faults.ENV_SCOPE: "process",
    }
    args = [sys.executable, "-c", RETAIN, str(tmp_path / "runs"), "killed", str(base), "5"]
    first = subprocess.run(args, env=env, capture_output=True, timeout=120)
    assert first.returncode == -signal.SIGKILL, first.stderr.decode()[-2000:]
    assert json.loads((tmp_path / "fired" / "prune_mid.fired").read_text())["point"] == "prune:mid"
    # the first deletion (update 0's weights): marker rewritten, folder still on disk; update 1 untouched
    update0 = layout.step(0, "update-shared")
    assert update0.files() == ["metrics.json"] and (Path(update0.path) / "model").is_dir()
    assert "model/model.safetensors" in layout.step(1, "update-shared").files()
    # the run resumes: iteration 6 starts from update 5 and its snapshot
    start = weights_before(layout, config, "shared", 6)
    assert start.model_dir.endswith("iter-5/update-shared/model") and start.optimizer_age == 0
    assert state_of(layout, 5) != state_of(reference, 5)

    second = subprocess.run(args, env=env, capture_output=True, timeout=120)  # the point fired once: no crash
    assert second.returncode == 0, second.stderr.decode()[-2000:]
    assert state_of(layout, 5) == state_of(reference, 5)
    assert held(layout, 5) == ([3, 4, 5], [3, 4, 5])
    assert json.loads(Path(update0.marker_path).read_text())["metadata"]["pruned"][0]["by"] == RETENTION_BY
    assert (Path(update0.path) / MARKER).exists()
