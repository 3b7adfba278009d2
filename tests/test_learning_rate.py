"""The learning rate in ``training.lr`` is the one the optimizer steps with: one-shot (``run_update``, as
``pettingflow update`` runs it: a learner started for the one update) and resident (a learner kept across updates),
at 1 and 2 ranks.

From a fresh optimizer, AdamW's first step moves every parameter by ``lr * g / (|g| + eps)`` (bias-corrected
moments; no weight decay here), so the largest move of any weight is ``lr`` to ~1e-6: read from the weights the
update wrote, whatever wraps the optimizer. A resident learner keeps its optimizer across updates, so its second
update, with another lr, must step with that one: read from the param groups of the optimizer that steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import test_training_worker
from safetensors.torch import load_file
from test_training_worker import make_rows, spec_for, write_batch

from pettingflow.training.checkpoint import BASE_WEIGHTS
from pettingflow.training.launch import UpdateSpec
from pettingflow.training.learner import run_update

tiny_model_dir = test_training_worker.tiny_model_dir  # the same session fixture (one tiny model per test run)

# one optimizer step per update: the 4 rows are one mini-batch
TRAIN = {"dtype": "fp32", "zero_stage": 0, "micro_batch_size": 2, "mini_batch_size": 4, "weight_decay": 0.0}
LR, SECOND_LR = 3e-3, 7e-4  # neither is TrainingSettings' default (1e-5) nor the test helpers' (5e-3)


def _spec(tmp: Path, k: int, init: Path, start: Path, ranks: int, lr: float) -> UpdateSpec:
    batch = write_batch(tmp / f"batch-{k}.parquet", make_rows(4, seed=30 + k), [1.0, -1.0, 0.5, -0.5])
    return spec_for(
        batch,
        tmp / f"out-{k}",
        start,
        training=TRAIN | {"lr": lr, "num_processes": ranks},
        base_model_dir=str(init),
        start_weights=f"v{k - 1}" if k else BASE_WEIGHTS,
        weights_uri=f"v{k}",
        seed=k,
    )


def largest_move(metrics: dict, start: Path) -> float:
    after = load_file(str(Path(metrics["outputs"]["model"]) / "model.safetensors"))
    before = load_file(str(start / "model.safetensors"))
    assert after.keys() == before.keys()
    return max(float((after[k].double() - before[k].double()).abs().max()) for k in before)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_one_shot_update_steps_with_the_configured_lr(tiny_model_dir, tmp_path, ranks):
    metrics = run_update(_spec(tmp_path, 0, tiny_model_dir, tiny_model_dir, ranks, LR), timeout_s=300)
    assert metrics["num_processes"] == ranks and metrics["optimizer_steps"] == 1
    assert largest_move(metrics, tiny_model_dir) == pytest.approx(LR, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_resident_learner_steps_with_each_updates_lr(local_ray, tiny_model_dir, tmp_path, ranks):
    from pettingflow.training.learner import Learner

    learner = Learner("shared", ranks, tmp_path / "logs", master_host="127.0.0.1").start()
    try:
        first = learner.update(_spec(tmp_path, 0, tiny_model_dir, tiny_model_dir, ranks, LR))
        assert first["num_processes"] == ranks and first["optimizer_steps"] == 1
        assert largest_move(first, tiny_model_dir) == pytest.approx(LR, rel=1e-4)
        assert {lr for lrs in learner.call_all("optimizer_lrs") for lr in lrs} == {LR}

        start = Path(first["outputs"]["model"])
        second = learner.update(_spec(tmp_path, 1, tiny_model_dir, start, ranks, SECOND_LR))
        assert second["optimizer_state"] == "resident" and second["optimizer_steps"] == 1
        assert {lr for lrs in learner.call_all("optimizer_lrs") for lr in lrs} == {SECOND_LR}
        assert 0 < largest_move(second, start) < 2 * SECOND_LR  # Adam's second step: about lr, never ~LR
    finally:
        learner.stop()
