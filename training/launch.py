"""The update spec: what one update reads, starts from and writes (the launch path is ``training.learner``).

``UpdateSpec`` describes one update (batch, starting weights, optimizer snapshot, settings); ``spec_from_config``
is the only place that builds it from a config, for the flows, the resident learner and ``pettingflow update``
alike. Every update runs in the ranks of a ``training.learner.Learner`` (one Ray actor per rank around the recipe,
``training.worker.UpdateWorker``): a run keeps its learner for all its updates (``training.learner: resident``);
``learner.run_update(spec)`` starts one for this update and stops it after (``pettingflow update``, a re-run without
servers, ``training.learner: process``), so the one-shot update is the resident code, not a second implementation.
A failed update raises ``UpdateError`` with the tail of every rank's log. This module imports no torch and no Ray
at import time, so a Prefect flow can import it cheaply.

Output folders: ranks write to a local folder. When ``out_dir`` is a remote fsspec URI (``s3://...``), the update
runs in a local staging folder that is uploaded afterwards (``StagedOutput``); model/adapter/resume inputs must be
local folders.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pettingflow.configs.settings import AlgorithmSettings, LoraSettings, Specialization, TrainingSettings
from pettingflow.training.checkpoint import BASE_WEIGHTS, PolicyWeights, optimizer_snapshot_written

log = logging.getLogger(__name__)

SPEC_FILE = "spec.json"
LOG_FILE = "worker.log"
METRICS_FILE = "metrics.json"


class StartSources(BaseModel):
    """Where an update's start weights live in storage rather than on one machine: a learner rank on another
    node than the flow's makes its own local copies from these (``runs.lineage.localize_start``), since the
    folders in ``UpdateSpec`` (``init_model_dir``, ``resume_dir``, ...) are the flow node's."""

    model_config = ConfigDict(extra="forbid")

    base_model: str = Field(description="The policy's `model`: a prepared model name, or a folder every node has.")
    weights: str | None = Field(
        None, description="URI of the committed update step holding model/ or adapters/; None: the base model."
    )
    snapshot: str | None = Field(None, description="URI of the committed step holding deepspeed/ (resume_dir).")


#: fields of ``UpdateSpec`` renamed since specs were first stored: old name -> new name (still read)
LEGACY_FIELDS = {"start_version": "start_weights", "version": "weights_uri"}


class UpdateSpec(BaseModel):
    """Everything one update job needs; serialised to ``spec.json`` for the worker process."""

    model_config = ConfigDict(extra="forbid")

    batch_uri: str = Field(description="Batch Parquet (file or folder): trajectory columns + 'advantage'.")
    policy: str = Field(min_length=1, description="Policy name; every row's policy_name must equal it.")
    out_dir: str = Field(description="Output folder: local path or fsspec URI (uploaded after the job).")
    init_model_dir: str = Field(description="Local HF folder of the current weights (LoRA: the base model).")
    base_model_dir: str | None = Field(
        None, description="Local HF folder of the KL reference (full weights); default init_model_dir."
    )
    adapters_in: dict[str, str | None] | None = Field(
        None, description="LoRA: agent -> previous adapter folder, or None/absent for a fresh adapter."
    )
    resume_dir: str | None = Field(
        None, description="A previous job's deepspeed/ folder: weights and optimizer state are restored from it."
    )
    specialization: Specialization = Specialization.prompt
    agents: list[str] = Field(default_factory=list, description="Agents of this policy, in turn order.")
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings)
    lora: LoraSettings = Field(default_factory=LoraSettings)
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options for batch_uri and a remote out_dir."
    )
    seed: int = Field(0, description="Seeds fresh LoRA adapters (and torch's RNG in the worker).")
    save_resume_state: bool = Field(
        True,
        description="Write deepspeed/ (weights + optimizer state, ~13x the bf16 weights for a full model) "
        "so that the next job can resume exactly.",
    )
    start_weights: str | None = Field(
        None,
        description="Which weights the update starts from: 'base' or the URI of the update step holding them. A "
        "resident learner that holds exactly these weights continues in memory; None: unknown (always load).",
    )
    weights_uri: str | None = Field(
        None, description="The URI the weights written by this update will have once committed (its step's URI)."
    )
    optimizer_age: int = Field(
        0, ge=0, description="Updates between the resume_dir snapshot and the starting weights (0: exact)."
    )
    num_threads: int | None = Field(None, ge=1, description="torch threads for this update (None: leave as is).")
    start_sources: StartSources | None = Field(
        None, description="The start weights in storage, for ranks on other nodes (None: only local folders known)."
    )
    out_uri: str | None = Field(
        None,
        description="Where out_dir's files belong in remote storage (the update step's URI): a rank on another node "
        "than the flow's writes into a folder of its own and uploads its files there. None: storage is local.",
    )

    @model_validator(mode="before")
    @classmethod
    def _read_old_names(cls, data: Any) -> Any:
        """A ``spec.json`` written before the fields were renamed (``LEGACY_FIELDS``) still reads: "version" meant
        the lineage's integer elsewhere and a step URI here, so these fields got names of their own."""
        if isinstance(data, dict) and any(old in data for old in LEGACY_FIELDS):
            data = dict(data)
            for old, new in LEGACY_FIELDS.items():
                if old in data:
                    if new in data:
                        raise ValueError(f"spec gives both {old!r} and {new!r}; {old!r} is the old name of {new!r}")
                    data[new] = data.pop(old)
        return data

    @model_validator(mode="after")
    def _check(self) -> UpdateSpec:
        if self.specialization is Specialization.lora:
            if not self.agents:
                raise ValueError("specialization 'lora' needs the policy's agent names (one adapter per agent)")
            if self.lora.rank <= 0:
                raise ValueError("specialization 'lora' needs lora.rank > 0")
            if len(set(self.agents)) != len(self.agents):
                raise ValueError(f"duplicate agent names in {self.agents}")
        if self.adapters_in and self.specialization is not Specialization.lora:
            raise ValueError("adapters_in only applies to specialization 'lora'")
        return self

    @property
    def uses_lora(self) -> bool:
        return self.specialization is Specialization.lora

    @property
    def reference_dir(self) -> str:
        return self.base_model_dir or self.init_model_dir


def build_key(spec: UpdateSpec) -> str:
    """Everything that shapes the engine a worker builds; a resident worker rebuilds when it changes.

    Batch, output, learning rate and the loss settings are not part of it: they apply per update.
    """
    t = spec.training
    parts = {
        "policy": spec.policy,
        "specialization": spec.specialization.value,
        "agents": list(spec.agents),
        "lora": spec.lora.model_dump() if spec.uses_lora else None,
        "reference": spec.reference_dir if spec.algorithm.kl_coef > 0 else None,
        "engine": [
            t.num_processes,
            t.zero_stage,
            t.dtype,
            t.micro_batch_size,
            t.micro_steps(t.num_processes),
            t.gradient_checkpointing,
            t.offload_optimizer,
            t.offload_params,
        ],
        "optimizer": [t.weight_decay, t.max_grad_norm],
    }
    return json.dumps(parts, sort_keys=True)


class UpdateError(RuntimeError):
    """An update failed; the message holds the reason and the tail of every rank's log. ``returncode``: 1 when a
    rank raised, None when a rank was lost or the update timed out; ``log_path``: rank 0's log file."""

    def __init__(self, message: str, returncode: int | None = None, log_path: str | None = None):
        super().__init__(message)
        self.returncode = returncode
        self.log_path = log_path


class StagedOutput:
    """The local folder an update writes into, and the upload afterwards when ``out_dir`` is remote.

    Workers write to local folders only (DeepSpeed and ``save_pretrained`` need them). For an fsspec
    ``out_dir`` (``s3://...``) the update runs in a temporary folder that ``finish`` uploads, rewriting the
    output paths in the metrics to the remote ones. It also writes ``spec.json`` and removes a stale
    ``metrics.json`` from an earlier attempt, so it can never pass for this one's.
    """

    def __init__(self, spec: UpdateSpec):
        from pettingflow.storage.fs import filesystem, is_local

        self.out_dir = spec.out_dir
        self.fs, self.out_path = filesystem(spec.out_dir, spec.storage_options)
        self.remote = not is_local(self.fs)
        self.local_out = Path(tempfile.mkdtemp(prefix="pettingflow-update-") if self.remote else self.out_path)
        self.local_out.mkdir(parents=True, exist_ok=True)
        self.spec = spec.model_copy(update={"out_dir": str(self.local_out)})
        (self.local_out / SPEC_FILE).write_text(self.spec.model_dump_json(indent=2))
        stale = self.local_out / METRICS_FILE
        if stale.exists():
            stale.unlink()

    def finish(self, metrics: dict[str, Any], log_name: str) -> dict[str, Any]:
        """Upload a remote output, then add ``out_dir`` and ``log_path`` to the metrics."""
        if self.remote:
            self.fs.put(str(self.local_out) + "/", self.out_path, recursive=True)
            metrics = rebase_outputs(metrics, str(self.local_out), self.fs.unstrip_protocol(self.out_path))
            shutil.rmtree(self.local_out, ignore_errors=True)
        metrics["out_dir"] = self.out_dir
        metrics["log_path"] = (
            self.out_dir.rstrip("/") + "/" + log_name if self.remote else str(self.local_out / log_name)
        )
        return metrics


def rebase_outputs(metrics: dict[str, Any], local: str, remote: str) -> dict[str, Any]:
    """``metrics`` with every path under ``local`` (a staging folder) rewritten to ``remote`` (where its files were
    uploaded), so the outputs an update reports name where they are, not a deleted temp folder."""
    text = json.dumps(metrics).replace(json.dumps(local)[1:-1], json.dumps(remote)[1:-1])
    return json.loads(text)


def spec_from_config(
    config: Any,
    *,
    policy: str,
    batch_uri: str,
    out_dir: str,
    start: PolicyWeights,
    iteration: int = 0,
    weights_uri: str | None = None,
    save_optimizer: bool | None = None,
    num_threads: int | None = None,
    out_uri: str | None = None,
) -> UpdateSpec:
    """The ``UpdateSpec`` of ``policy``'s update at ``iteration`` of an ``ExperimentConfig``: the only builder.

    ``start`` says where the update starts (weights, adapters, optimizer snapshot and its age). The seed is
    ``run.seed + iteration`` and the optimizer snapshot follows ``training.save_optimizer_every`` and
    ``training.replay_snapshots`` (``optimizer_snapshot_written``) unless ``save_optimizer`` says otherwise (a
    re-run's update writes none: nothing starts from it), so ``pettingflow update --iteration K``
    builds exactly the spec the flow builds for iteration K.
    """
    from pettingflow.configs.settings import Specialization as Spec

    settings = config.policy(policy)  # KeyError naming the defined policies
    lora = config.specialization is Spec.lora
    if save_optimizer is None:
        t = config.training
        save_optimizer = optimizer_snapshot_written(
            t.save_optimizer_every, t.replay_snapshots, iteration, config.run.iterations
        )
    return UpdateSpec(
        batch_uri=batch_uri,
        policy=policy,
        out_dir=out_dir,
        init_model_dir=start.model_dir,
        base_model_dir=start.base_dir,
        adapters_in=(dict(start.adapters) or None) if lora else None,
        resume_dir=start.deepspeed_dir,
        optimizer_age=start.optimizer_age if start.deepspeed_dir else 0,
        specialization=config.specialization,
        agents=[a.name for a in config.agents_of(policy)],
        training=config.training,
        algorithm=config.algorithm,
        lora=settings.lora,
        storage_options=dict(config.run.storage_options),
        seed=config.run.seed + iteration,
        save_resume_state=save_optimizer,
        start_weights=start.source,
        weights_uri=weights_uri,
        num_threads=num_threads if num_threads is not None else config.training.num_threads,
        start_sources=start_sources(settings.model, start),
        out_uri=out_uri,
    )


def start_sources(base_model: str, start: PolicyWeights) -> StartSources | None:
    """``start`` as storage sources: the base model, or a committed update step (version >= 1) and the step of its
    optimizer snapshot. None for weights known only as folders (``pettingflow update --init DIR``)."""
    if start.source == BASE_WEIGHTS:
        return StartSources(base_model=base_model)
    if start.version < 1:
        return None
    snapshot = start.snapshot_source if start.deepspeed_dir else None
    return StartSources(base_model=base_model, weights=start.source, snapshot=snapshot)
