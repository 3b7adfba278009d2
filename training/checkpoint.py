"""The layout of a policy checkpoint: one place for the writer (the update worker) and the readers
(``runs/lineage.py``, weight sync, evaluation).

An update step's folder holds::

    model/              full weights (HF safetensors + tokenizer files): what vLLM reloads, the next update's start
    adapters/<agent>/   LoRA: one peft folder per agent, instead of model/
    deepspeed/          optional optimizer snapshot (DeepSpeed checkpoint: weights + Adam moments + step count)
    metrics.json        written last

``BASE_WEIGHTS`` names the untrained weights of a policy; every trained state is named by the URI of the
committed update step that holds it, so "which weights does this learner hold" is a string comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODEL_SUBDIR = "model"
ADAPTERS_SUBDIR = "adapters"
DEEPSPEED_SUBDIR = "deepspeed"
BASE_WEIGHTS = "base"


@dataclass(frozen=True)
class PolicyWeights:
    """A policy's weights (and optimizer snapshot) as local folders: where an update starts, what a server serves."""

    policy: str
    base_dir: str  # the base model: reference for KL, tokenizer, what LoRA adapters sit on
    model_dir: str  # full weights to serve and to train from (== base_dir for LoRA or before any update)
    adapters: dict[str, str] = field(default_factory=dict)  # agent -> adapter folder (LoRA, after an update)
    deepspeed_dir: str | None = None  # the newest optimizer snapshot at or before these weights
    snapshot_source: str | None = None  # the URI of the step holding deepspeed_dir (a rank on another node reads it)
    optimizer_age: int = 0  # updates between that snapshot and these weights (0: the snapshot is of these weights)
    source: str = BASE_WEIGHTS  # BASE_WEIGHTS or the URI of the update step they come from
    version: int = 0  # 0 = base, k + 1 = written by the update of iteration k (rows record it: policy_version)


def optimizer_snapshot_due(save_every: int, iteration: int, iterations: int | None = None) -> bool:
    """Whether the update of ``iteration`` also writes an optimizer snapshot: every ``save_every`` iterations
    (counted from 1, so with 4: iterations 3, 7, 11, ...) and at a run's last iteration; never when 0."""
    if save_every <= 0:
        return False
    return (iteration + 1) % save_every == 0 or (iterations is not None and iteration == iterations - 1)


def optimizer_snapshot_written(save_every: int, replay: int, iteration: int, iterations: int | None = None) -> bool:
    """Whether the original update of ``iteration`` writes an optimizer snapshot: when due
    (``optimizer_snapshot_due``) or always while ``training.replay_snapshots`` (``replay``) is above 0, because a
    re-run of iteration k + 1 replays exactly only from the snapshot of the weights after iteration k; never with
    ``save_every`` 0, which keeps its meaning (no snapshot on disk at all, e.g. for studies that fill a disk)."""
    return save_every > 0 and (replay > 0 or optimizer_snapshot_due(save_every, iteration, iterations))


def replay_snapshot_kept(
    iteration: int, newest: int, save_every: int, replay: int, iterations: int | None = None
) -> bool:
    """Whether the snapshot written after ``iteration`` stays once the one after ``newest`` is committed: a due one
    always (resume points, ``optimizer_snapshot_due``), any other while it is among the ``replay`` + 1 newest
    (``iteration >= newest - replay``): the snapshots the last ``replay`` iterations start from, and the newest,
    which the next iteration (or a resume) starts from. Pure: the rule is tested apart from storage."""
    return optimizer_snapshot_due(save_every, iteration, iterations) or (replay > 0 and iteration >= newest - replay)
