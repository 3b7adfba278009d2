"""`pettingflow runs prune`: which checkpoints go, that the rest of a step survives, and that whatever needs a
pruned checkpoint fails loudly instead of silently starting from the base model."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_weights_before import commit_update, setup  # noqa: F401 (setup: a run layout and a config on a fake base model)
from typer.testing import CliRunner

from pettingflow.cli import app
from pettingflow.runs.lineage import PrunedWeightsError, weights_before
from pettingflow.runs.retention import kept_iterations, plan_prune, prune
from pettingflow.storage import RunLayout


def four_updates(layout: RunLayout) -> None:
    for k in range(4):
        commit_update(layout, k, snapshot=k in (1, 3))


def test_kept_iterations_rule() -> None:
    assert kept_iterations([0, 1, 2, 3], keep_last=1, keep_every=0) == {3}
    assert kept_iterations([0, 1, 2, 3, 4], keep_last=2, keep_every=2) == {1, 3, 4}
    assert kept_iterations([0, 2, 5], keep_last=1, keep_every=3) == {2, 5}  # iterations without an update: absent
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        kept_iterations([0, 1], keep_last=0, keep_every=0)
    with pytest.raises(ValueError, match="keep_every must be >= 0"):
        kept_iterations([0, 1], keep_last=1, keep_every=-1)


def test_prune_weights_keeps_other_files_and_refuses_pruned_starts(setup) -> None:  # noqa: F811
    layout, config, _ = setup
    four_updates(layout)
    targets = plan_prune(layout, keep_last=1, keep_every=2)  # keeps 1 and 3
    assert [(t.policy, t.iteration, t.files) for t in targets] == [("shared", 0, 1), ("shared", 2, 1)]
    assert prune(targets) == len(b"w0") + len(b"w2")

    for k in (0, 2):
        step = layout.step(k, "update-shared")
        assert step.files() == ["metrics.json"] and step.read_json("metrics.json") == {"loss": float(k)}
        assert not (Path(step.path) / "model").exists()
        assert step.pruned()[0]["prefixes"] == ["model/", "adapters/", "deepspeed/"]
    # iterations 1 and 3 start from pruned weights: an error naming the prune, never the base model
    for k in (1, 3):
        with pytest.raises(PrunedWeightsError, match=f"after iteration {k - 1} .*pettingflow runs prune"):
            weights_before(layout, config, "shared", k)
    kept = weights_before(layout, config, "shared", 2)
    assert kept.model_dir.endswith("iter-1/update-shared/model") and kept.optimizer_age == 0
    assert weights_before(layout, config, "shared", 4).deepspeed_dir.endswith("iter-3/update-shared/deepspeed")
    assert plan_prune(layout, keep_last=1, keep_every=2) == []  # nothing left to do


def test_optimizer_only_prune_keeps_every_iteration_rerunnable(setup) -> None:  # noqa: F811
    layout, config, _ = setup
    four_updates(layout)
    targets = plan_prune(layout, keep_last=1, optimizer_only=True)
    assert [t.iteration for t in targets] == [1]  # the only snapshot outside the newest update
    prune(targets, optimizer_only=True)
    start = weights_before(layout, config, "shared", 2)  # weights of update 1 still there, its snapshot not
    assert start.model_dir.endswith("iter-1/update-shared/model") and start.deepspeed_dir is None
    assert not (Path(layout.step(1, "update-shared").path) / "deepspeed").exists()


def test_an_interrupted_prune_is_finished_by_the_next(setup) -> None:  # noqa: F811
    layout, config, _ = setup
    four_updates(layout)
    prune(plan_prune(layout, keep_last=1, optimizer_only=True), optimizer_only=True)  # update 1's snapshot
    leftover = Path(layout.step(1, "update-shared").path) / "deepspeed"
    leftover.mkdir()  # as if the process died after rewriting the marker, before deleting the folder
    (leftover / "latest").write_bytes(b"half")
    assert weights_before(layout, config, "shared", 2).deepspeed_dir is None  # unlisted: not a snapshot
    assert layout.step(1, "update-shared").prune(("deepspeed/",), {"at": "again"}) == []
    assert not leftover.exists()


def test_cli_dry_run_then_delete(setup, tmp_path: Path) -> None:  # noqa: F811
    layout, _, _ = setup
    layout.write_run_info({"config_name": "code-env", "created": "2026-11-25T00:00:00"})
    four_updates(layout)
    root = ["--root", layout.root]
    runner = CliRunner()
    dry = runner.invoke(app, ["runs", "prune", "r1", *root])
    assert dry.exit_code == 0 and "would free" in dry.output and "iteration 0" in dry.output
    assert (Path(layout.step(0, "update-shared").path) / "model").exists()  # a dry run deletes nothing

    done = runner.invoke(app, ["runs", "prune", "r1", *root, "--yes"])
    assert done.exit_code == 0 and "freed" in done.output and "3 update steps" in done.output
    assert not (Path(layout.step(0, "update-shared").path) / "model").exists()
    shown = runner.invoke(app, ["runs", "show", "r1", *root])
    assert "pruned" in shown.output

    again = runner.invoke(app, ["runs", "prune", "r1", *root, "--yes"])
    assert again.exit_code == 0 and "nothing to prune" in again.output
    missing = runner.invoke(app, ["runs", "prune", "no-such-run", *root])
    assert missing.exit_code == 2 and "no run 'no-such-run'" in missing.output


def test_background_snapshots_are_pruned_with_their_update(setup) -> None:  # noqa: F811
    """``training.optimizer_snapshot: background`` stores a snapshot in ``optimizer-<policy>``, beside its update:
    pruning that iteration removes it too, and a prune never leaves the newest one behind by mistake."""
    layout, config, _ = setup
    for k in range(3):
        commit_update(layout, k, snapshot=False)
        snapshot = layout.step(k, "optimizer-shared")
        snapshot.begin()
        snapshot.write_bytes("deepspeed/latest", b"global_step%d" % k)
        snapshot.commit({"policy": "shared"})
    targets = plan_prune(layout, keep_last=1, optimizer_only=True)
    assert [(t.iteration, t.step.name) for t in targets] == [(0, "optimizer-shared"), (1, "optimizer-shared")]
    prune(targets, optimizer_only=True)
    assert weights_before(layout, config, "shared", 2).deepspeed_dir is None  # update 1's snapshot is gone
    assert weights_before(layout, config, "shared", 3).deepspeed_dir.endswith("iter-2/optimizer-shared/deepspeed")
    full = plan_prune(layout, keep_last=1)
    assert [(t.iteration, t.step.name) for t in full] == [(0, "update-shared"), (1, "update-shared")]
