"""The update recipe of one rank: ``UpdateWorker.update(spec)``, read top to bottom (torchtune's shape).

Every update runs it in the ranks of a learner (``training/learner.py``: one Ray actor per rank): the resident
learner of a run calls it once per iteration on the same object, ``learner.run_update`` (``pettingflow update``, a
re-run without servers) starts a learner for one call. Tests and benches may call it in their own process.

One update::

    read rows -> prepare (keep resident state | build + restore) -> plan -> train -> save

- ``read rows``: drop untrainable rows (counted). An empty batch stops here: ``metrics.json`` says
  ``skipped: true``, no weights are written and the resident state is untouched.
- ``prepare``: keep the engine when it holds this update's starting weights (``holds == spec.start_weights``) and
  its shape (``launch.build_key``) is unchanged; else ``build`` and ``restore``.
- ``build`` (setup): ``torch.distributed`` (gloo on CPU, NCCL on GPU), the policy (full weights, or base + one LoRA
  adapter per agent) and, when ``kl_coef > 0``, the reference, wrapped in a DeepSpeed engine (ZeRO stage and
  bf16 from the config, the optimizer from ``optim.OptimizerConfig``, a client ``torch.optim.AdamW`` so no
  DeepSpeed op is JIT-compiled).
- ``restore``: optimizer state from ``resume_dir`` (a ``deepspeed/`` snapshot). When the snapshot is older
  than the start weights (``optimizer_age > 0``), its moments are kept and the weights are set back to the
  start weights. The metrics say which case happened (``optimizer_state``: new | resident | restored | stale |
  reset), so a restart never silently resets Adam.
- ``plan``: optimizer-step windows over the rows (``data.plan_windows``) and this rank's micro-batches.
- ``train`` (the train step): old and reference log-probs once (``logprobs.micro_batch_logprobs``), then
  ``epochs`` PPO passes: per micro-batch ``logprobs.micro_batch_loss`` and a backward, per window one optimizer
  step. With one epoch, the first window's old log-probs equal the current ones exactly (no optimizer step has
  happened yet), so that forward pass is skipped (as TRL does with one iteration per batch).
- ``save``: ``model/`` (full: HF safetensors + tokenizer files) or ``adapters/<agent>/`` (LoRA: peft
  folders), ``deepspeed/`` when ``save_resume_state``, then ``metrics.json`` last: its presence means the
  update finished.

L2 (LoRA): every window (optimizer step) holds one agent's rows, and the optimizer skips the param groups of
all other adapters (``GroupMaskedAdamW``), so an adapter's weights and optimizer state change only on steps
made of its own agent's rows; an agent without rows keeps its adapter bit-identical.
"""

from __future__ import annotations

import functools
import gc
import importlib
import json
import logging
import math
import os
import resource
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from pettingflow.training.checkpoint import ADAPTERS_SUBDIR, BASE_WEIGHTS, DEEPSPEED_SUBDIR, MODEL_SUBDIR
from pettingflow.training.launch import METRICS_FILE, UpdateSpec, build_key

log = logging.getLogger("pettingflow.training.worker")

LOSS_METRICS = ("loss", "pg_loss", "clip_fraction", "dual_clip_fraction", "approx_kl", "ratio_mean", "entropy", "kl")
# the loss terms: means in ``algorithm.loss_agg_mode`` (the others are means over model tokens, whatever the mode)
AGG_MODE_METRICS = ("loss", "pg_loss", "kl", "entropy")
# the terms of the loss whose gradient a step takes: over the whole window's denominator, skipped rows included
GRADIENT_METRICS = ("loss", "pg_loss")
# summed over ranks, not averaged (``_loss_metrics``)
COUNT_METRICS = ("model_tokens", "tokens", "computed_tokens", "micro_batches", "old_logprob_forwards_skipped")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def ensure_dist_env() -> None:
    """Single-process defaults for the variables torch.distributed reads, for the recipe run in a caller's own
    process (tests, benches); a learner's ranks set them from the learner (``LearnerRank``)."""
    if "MASTER_PORT" not in os.environ:
        from pettingflow.processes import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")


def disable_shm_comm() -> None:
    """Skip DeepSpeed's ``deepspeed_shm_comm`` op on CPU.

    ``deepspeed.init_distributed`` JIT-compiles it (about 45 s, more under load; cached in
    ``~/.cache/torch_extensions``) although only ``inference_all_reduce`` (tensor-parallel inference) uses it;
    training collectives go through torch.distributed/gloo either way. Set ``PETTINGFLOW_DS_SHM_COMM=1`` to keep
    DeepSpeed's default.
    """
    if os.environ.get("PETTINGFLOW_DS_SHM_COMM") == "1":
        return
    # `import deepspeed.comm.torch as m` would bind deepspeed.comm's attribute `torch` (the torch package)
    comm_torch = importlib.import_module("deepspeed.comm.torch")
    comm_torch.build_shm_op = lambda: None


def dist_backend() -> str:
    """gloo on CPU (the only backend verified here); nccl when CUDA is present (unverified). Override with
    ``PETTINGFLOW_DIST_BACKEND``."""
    override = os.environ.get("PETTINGFLOW_DIST_BACKEND")
    if override:
        return override
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def check_gpu_for_rank() -> None:
    """Under CUDA each rank trains on ``cuda:LOCAL_RANK`` (DeepSpeed's placement): a rank without its own GPU
    fails here with what to change, not deep inside NCCL or with an invalid device ordinal."""
    import torch

    if not torch.cuda.is_available() or os.environ.get("PETTINGFLOW_DIST_BACKEND") == "gloo":
        return
    local_rank, gpus = _env_int("LOCAL_RANK", 0), torch.cuda.device_count()
    if local_rank >= gpus:
        raise RuntimeError(
            f"rank with LOCAL_RANK={local_rank} has no GPU of its own: this machine has {gpus} (NCCL needs one GPU per "
            f"rank). Set training.num_processes <= {gpus} per node, or CUDA_VISIBLE_DEVICES to show more GPUs"
        )


def allreduce_bucket_elements(zero_stage: int, world_size: int, model_config: Any) -> int | None:
    """Gradient elements per all-reduce at ZeRO-0 with several ranks: ``hidden_size ** 2`` (as the ZeRO stages'
    buckets, ``deepspeed_config``), or None to leave DeepSpeed's.

    Why: without ZeRO, DeepSpeed all-reduces the gradients at each optimizer step in buckets of a fixed 500M
    elements, flattening them into one new buffer first: for any model under 500M parameters a full extra copy of
    the gradients (0.54 GiB at 290M in bf16, measured as the step's peak by bench/memory.py). Buckets of
    hidden² elements bound that copy to a few MB plus the largest tensor. The sums are the same (each element
    is summed over the ranks whatever the bucket).
    """
    hidden = getattr(model_config, "hidden_size", None)
    if zero_stage != 0 or world_size < 2 or not hidden:
        return None
    return int(hidden) * int(hidden)


def share_fp32_master(optimizer: Any) -> int:
    """Let ZeRO-3's fp32 master partitions share the storage of fp32 weight partitions; returns the bytes freed.

    Why: when the weights are fp32 already, DeepSpeed's ZeRO-3 means to use the weight partition itself as the
    optimizer's master copy (the alias branch of ``DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions``), but
    0.19.8 enters that branch only if ``tensor.device == self.device``, a ``torch.device`` against a device *name*
    (``'cpu'``, ``'cuda:0'``), which is never equal: every rank then keeps a redundant fp32 copy, 4 B per
    parameter / ranks (docs/benchmarks.md, memory). This makes the alias the branch would have made: the master
    tensor (the object the optimizer and its state know) takes the weight partition's storage; DeepSpeed's
    copy of the master into the weights after each step is then a copy onto itself, as in that branch. Only for
    partitions of equal dtype, shape, device and values, with no optimizer or parameter offload (a master
    elsewhere is meant to be separate); anything else is left as DeepSpeed built it.
    """
    import torch

    weights = getattr(optimizer, "fp16_partitioned_groups_flat", None)
    masters = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    if not weights or not masters or getattr(optimizer, "offload_optimizer", False):
        return 0
    if getattr(optimizer, "offload_param", False) or getattr(optimizer, "params_in_nvme_and_cpu", False):
        return 0
    freed = 0
    for weight, master in zip(weights, masters, strict=True):
        if weight is None or master is weight or master.data_ptr() == weight.data_ptr():
            continue
        if (weight.dtype, weight.shape, weight.device) != (master.dtype, master.shape, master.device):
            continue
        if not torch.equal(weight, master):
            raise RuntimeError("ZeRO-3 master partition differs from its weight partition before any step")
        master.data = weight.data
        freed += weight.numel() * weight.element_size()
    return freed


def max_over_ranks(value: int) -> int:
    """The largest ``value`` over all ranks (one all-reduce on the default process group)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def collective_device() -> Any:
    """Where a tensor for a torch.distributed collective must live: the rank's GPU under NCCL (which refuses CPU
    tensors), the CPU under gloo."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def deepspeed_config(t: Any, world_size: int, dtype: str, hidden_size: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config of a ``TrainingSettings`` at ``world_size`` ranks (``dtype``: fp32 | bf16, resolved).

    ``hidden_size`` (the model's) sizes ZeRO's communication buckets as transformers' Trainer does for "auto":
    ``hidden²`` elements instead of DeepSpeed's fixed 5e8, which ZeRO-3 keeps allocated for the whole run
    (1.9 GiB per rank in fp32, whatever the model: bench/memory.py measured ZeRO-3 holding 3.9x ZeRO-0's state
    on a 30M model with it, 0.50x without).

    The accumulation steps are derived (``TrainingSettings.micro_steps``), so a mini-batch is the same rows
    at any world size. ZeRO-3 gathers 16-bit weights on save (the HF checkpoint is written from them).
    Offload keeps the optimizer (and, ZeRO-3, parameter) shards in host memory; the client optimizer is torch's
    AdamW, which DeepSpeed accepts for offload once ``zero_force_ds_cpu_optimizer`` is off (its own
    ``DeepSpeedCPUAdam`` would be JIT-compiled at the first run).
    """
    micro_steps = t.micro_steps(world_size)
    zero: dict[str, Any] = {"stage": t.zero_stage}
    if t.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if t.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if t.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    if hidden_size and t.zero_stage > 0:
        zero["reduce_bucket_size"] = hidden_size * hidden_size
        if t.zero_stage < 3:
            zero["allgather_bucket_size"] = hidden_size * hidden_size
        else:
            zero["stage3_prefetch_bucket_size"] = int(0.9 * hidden_size * hidden_size)
            zero["stage3_param_persistence_threshold"] = 10 * hidden_size
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": micro_steps,
        "train_batch_size": t.micro_batch_size * micro_steps * world_size,
        "gradient_clipping": t.max_grad_norm,
        "zero_optimization": zero,
        # master_weights=bf16: no mixed precision, the client AdamW steps the bf16 weights themselves
        "bf16": {"enabled": dtype == "bf16" and t.master_weights == "fp32"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if t.offload_optimizer or t.offload_params:
        config["zero_force_ds_cpu_optimizer"] = False
    return config


class _Accumulator:
    """Weighted sums and weights of named metrics, summed over ranks at the end; a metric is its sum / weight.

    Why sums and not each rank's mean: the ranks hold different shares of the rows (uneven splits, fillers), so
    only sums over all ranks give a value that does not depend on the world size (``UpdateWorker._record``).
    """

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, float] = defaultdict(float)

    def add(self, key: str, value: float, count: float = 1.0) -> None:
        self.sums[key] += value
        self.counts[key] += count

    def reduce(self, world_size: int) -> dict[str, tuple[float, float]]:
        sums, counts = dict(self.sums), dict(self.counts)
        if world_size > 1:
            import torch
            import torch.distributed as dist

            key_lists: list[list[str] | None] = [None] * world_size
            dist.all_gather_object(key_lists, sorted(sums))
            keys = sorted({k for ks in key_lists for k in (ks or [])})
            values = [sums.get(k, 0.0) for k in keys] + [counts.get(k, 0.0) for k in keys]
            t = torch.tensor(values, dtype=torch.float64, device=collective_device())
            dist.all_reduce(t)
            t = t.cpu()
            n = len(keys)
            sums = dict(zip(keys, t[:n].tolist(), strict=True))
            counts = dict(zip(keys, t[n:].tolist(), strict=True))
        return {k: (sums[k], counts[k]) for k in sums}


class UpdateWorker:
    """One rank's update recipe and, between updates, its resident model and optimizer.

    ``update(spec)`` may be called again and again on the same object (the learner does): the engine is kept
    while the spec's engine shape (``build_key``) and starting weights (``start_weights``) match what this object
    holds. ``spec`` here only serves callers that run the steps one by one (``bench/memory.py``).
    """

    def __init__(self, spec: UpdateSpec | None = None):
        self.spec: UpdateSpec = spec  # type: ignore[assignment]  # set per update
        self.rank = _env_int("RANK", 0)
        self.world_size = _env_int("WORLD_SIZE", 1)
        # resident state (kept across updates)
        self.engine: Any = None
        self.reference: Any = None
        self.client_optimizer: Any = None
        self.trainable: list[Any] = []
        self._model_config: Any = None  # the loaded model's config (sizes DeepSpeed's buckets)
        self.build_key: str | None = None
        self.dtype = "fp32"  # training.dtype resolved on this machine (build)
        self.holds: str | None = None  # which committed weights the engine holds; None = unknown/dirty
        self.updates_done = 0
        # per update
        self.out = Path(spec.out_dir) if spec is not None else Path(".")
        self.windows: list[Any] = []
        self.my_slots: list[list[Any]] = []  # per window: this rank's gas MicroBatches
        self.rows: Any = None
        self.resumed_from: str | None = None
        self.metrics: dict[str, Any] = {}
        self.timings: dict[str, float] = {}
        self.skipped = False
        self._grad_norms: list[float] = []

    # ------------------------------------------------------------------------------------------------ lifecycle
    def update(self, spec: UpdateSpec) -> dict[str, Any]:
        """Train on ``spec``'s batch from ``spec``'s starting weights; write weights and ``metrics.json``."""
        started = time.perf_counter()
        self._begin(spec)
        self.read_rows()
        if not self.skipped:
            self.metrics.update(self.prepare())
            import pettingflow.training.optim as optim  # torch: loaded with the engine, not with this module

            # this update's hyperparameters, also on a resident or restored optimizer
            optim.apply_config(self.client_optimizer, optim.OptimizerConfig.from_training(spec.training))
            self.metrics["dtype"] = self.dtype  # as resolved on this machine (training.dtype may be auto)
            self.metrics.update(self.numerics())
            self._seed()
            self.holds = None  # from here on the engine holds weights that are not committed anywhere
            self.plan()
            self.train()
            self.save_checkpoint()
            self.holds = spec.weights_uri
            self.updates_done += 1
            self.metrics.update(self.release_memory())
        self.metrics["duration_s"] = round(time.perf_counter() - started, 3)
        if self.rank == 0:
            self._write_metrics()
        return self.metrics

    def _begin(self, spec: UpdateSpec) -> None:
        self.spec = spec
        self.out = Path(spec.out_dir)
        self.windows, self.my_slots, self.rows = [], [], None
        self.resumed_from = None
        self.metrics, self.timings = {}, {}
        self.skipped = False
        self._grad_norms = []
        if spec.num_threads:
            import torch

            torch.set_num_threads(spec.num_threads)

    def read_rows(self) -> None:
        t0 = time.perf_counter()
        spec = self.spec
        from pettingflow.training.data import read_batch, samples_from_table

        table = read_batch(spec.batch_uri, spec.storage_options)
        self.rows = samples_from_table(table, spec.training.max_seq_len)
        self._check_rows()
        self.metrics.update(self._row_metrics())
        self.timings["read_s"] = time.perf_counter() - t0
        if not self.rows.samples:
            self.skipped = True
            self.metrics.update(skipped=True, reason="no trainable rows in the batch", outputs=None)
            log.warning("batch %s has no trainable rows: skipping the update", spec.batch_uri)

    def prepare(self) -> dict[str, Any]:
        """Keep the resident engine when it holds this update's starting weights; else build and restore."""
        spec = self.spec
        key = build_key(spec)
        if self.engine is not None and key == self.build_key and spec.start_weights == self.holds is not None:
            log.info("resident: continuing from %s in memory (optimizer moments carried over)", self.holds)
            return {"learner_loaded": False, "optimizer_state": "resident", "optimizer_age": 0}
        if self.engine is not None:
            why = "engine settings changed" if key != self.build_key else f"holds {self.holds}"
            log.info("rebuilding the learner state for start %s (%s)", spec.start_weights, why)
            self.release()
        t0 = time.perf_counter()
        self.build()
        self.build_key = key
        self.timings["setup_s"] = time.perf_counter() - t0
        status = self.restore()
        return {"learner_loaded": True, **status}

    def numerics(self) -> dict[str, Any]:
        """What decides this update's floating-point results besides its rows and settings, as it starts: torch's
        thread count (it sets how matmuls split their sums), torch's version and the device (the kernels), the
        precision of the weights the optimizer steps (``master_weights``: fp32 masters under DeepSpeed's bf16 mixed
        precision, else the weights' own dtype) and where the optimizer stands (DeepSpeed's ``global_step_start``,
        Adam's ``adam_step_start``, which sets its bias correction). World size, ZeRO stage and dtype are in the
        metrics already. Why record them: a re-run reproduces the original update bitwise only when all of them
        match, and ``runs/replay.py`` compares the two attempts' values to say whether it did."""
        import torch

        opt = self.engine.optimizer
        inner = getattr(opt, "optimizer", opt)
        steps = [float(s["step"]) for s in inner.state.values() if "step" in s]
        return {
            "torch_threads": torch.get_num_threads(),
            "torch_version": torch.__version__,
            "device": torch.device(self.engine.device).type,
            "master_weights": "fp32" if self.engine.bfloat16_enabled() else self.dtype,
            "global_step_start": int(self.engine.global_steps),
            "adam_step_start": int(max(steps, default=0.0)),
        }

    def _seed(self) -> None:
        """torch's RNG from the spec's seed before every update, not only when the engine is built: a resident
        learner's RNG state would otherwise depend on every earlier update, and a re-run (a fresh engine) could not
        draw the same numbers (dropout, anything random in a model's forward)."""
        import torch

        torch.manual_seed(self.spec.seed)

    def build(self) -> None:
        """Distributed group, policy (+ reference) and the DeepSpeed engine, from the spec's start weights."""
        spec = self.spec
        import deepspeed
        import torch
        import torch.distributed as dist

        import pettingflow.training.model as M
        import pettingflow.training.optim as optim

        torch.manual_seed(spec.seed)
        if not dist.is_initialized():
            ensure_dist_env()
            check_gpu_for_rank()
            disable_shm_comm()
            logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
            deepspeed.init_distributed(dist_backend=dist_backend())
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

        self.dtype = M.resolve_dtype(spec.training.dtype)
        dtype = M.torch_dtype(self.dtype)
        base = M.load_causal_lm(spec.init_model_dir, dtype)
        self._model_config = base.config
        if spec.training.gradient_checkpointing:
            # non-reentrant: gradients reach LoRA weights without making the embeddings' outputs require grad
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if spec.uses_lora:
            model = M.build_lora_model(base, spec.agents, spec.lora, spec.adapters_in)
            groups = M.adapter_parameter_groups(model, spec.agents)
            self.trainable = [p for g in groups for p in g["params"]]
            if spec.algorithm.kl_coef > 0:
                self.reference = "adapters_disabled"
        else:
            model = base
            model.requires_grad_(True)
            self.trainable = list(model.parameters())
            groups = [{"params": self.trainable, "adapter": None}]
            if spec.algorithm.kl_coef > 0:
                self.reference = M.load_reference(spec.reference_dir, dtype)
        self.client_optimizer = optim.build_optimizer(groups, optim.OptimizerConfig.from_training(spec.training))
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=self.client_optimizer, config=self.deepspeed_config()
        )
        bucket = allreduce_bucket_elements(spec.training.zero_stage, self.world_size, self._model_config)
        if bucket:
            self.engine.allreduce_gradients = functools.partial(self.engine.allreduce_gradients, bucket_size=bucket)
        freed = share_fp32_master(self.engine.optimizer)
        if freed:
            log.info("rank %d: ZeRO-3 master partitions alias the fp32 weights (%.2f GiB)", self.rank, freed / 2**30)
        if self.reference is not None and not isinstance(self.reference, str):
            self.reference.to(self.engine.device)
        log.info(
            "rank %d/%d: built %s from %s",
            self.rank,
            self.world_size,
            "LoRA " + ",".join(spec.agents) if spec.uses_lora else "full weights",
            spec.init_model_dir,
        )

    def plan(self) -> None:
        """Optimizer-step windows over the rows, and this rank's micro-batches on the engine's device."""
        from pettingflow.training.data import collate, filler, plan_windows

        spec = self.spec
        device = self.engine.device
        self.windows = plan_windows(
            self.rows.samples,
            spec.training.micro_batch_size,
            spec.training.rows_per_step,
            self.world_size,
            by_adapter=spec.uses_lora,
            loss_agg_mode=spec.algorithm.loss_agg_mode,
            skip_zero_advantage=self._skip_zero_advantage(),
        )
        for window in self.windows:
            mine = window.slots[self.rank]
            self.my_slots.append(
                [
                    (
                        collate(s, adapter=window.adapter) if s is not None else filler([window.first], window.adapter)
                    ).to(device)
                    for s in mine
                ]
            )
        self.metrics["rows_skipped_zero_advantage"] = sum(w.skipped for w in self.windows)
        mine = sum(len(s) for w in self.windows for s in w.slots[self.rank] if s is not None)
        log.info(
            "rank %d/%d: %d of %d rows, %d optimizer steps of <= %d rows, %d micro-steps each",
            self.rank,
            self.world_size,
            mine,
            len(self.rows.samples),
            len(self.windows),
            spec.training.rows_per_step,
            spec.training.micro_steps(self.world_size),
        )

    def _skip_zero_advantage(self) -> bool:
        """``training.skip_zero_advantage_rows``, checked again here: an update spec can be written by hand."""
        spec = self.spec
        if spec.training.skip_zero_advantage_rows and (spec.algorithm.kl_coef > 0 or spec.algorithm.entropy_coef > 0):
            raise ValueError(
                "training.skip_zero_advantage_rows needs algorithm.kl_coef=0 and algorithm.entropy_coef=0: a row "
                "whose advantage is 0 still has a gradient through the KL penalty or the entropy bonus"
            )
        return spec.training.skip_zero_advantage_rows

    def deepspeed_config(self) -> dict[str, Any]:
        hidden = getattr(self._model_config, "hidden_size", None)
        return deepspeed_config(self.spec.training, self.world_size, self.dtype, hidden)

    def restore(self) -> dict[str, Any]:
        """Optimizer state for the freshly built engine, and what it is: never a silent Adam restart."""
        spec = self.spec
        if not spec.resume_dir:
            if spec.start_weights in (None, BASE_WEIGHTS):
                return {"optimizer_state": "new", "optimizer_age": 0}
            log.warning(
                "optimizer state RESET: the weights of %s were trained, but no optimizer snapshot exists "
                "(training.save_optimizer_every); Adam moments restart at zero",
                spec.start_weights,
            )
            return {"optimizer_state": "reset", "optimizer_age": None}
        t0 = time.perf_counter()
        path, client_state = self.engine.load_checkpoint(
            spec.resume_dir,
            load_module_strict=not spec.uses_lora,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint found in {spec.resume_dir} (missing 'latest'?)")
        saved_agents = (client_state or {}).get("agents")
        if spec.uses_lora and saved_agents is not None and list(saved_agents) != list(spec.agents):
            raise ValueError(
                f"resume state {spec.resume_dir} holds adapters {saved_agents}, this job has {spec.agents}; "
                "the agents (and their order) must match to restore the optimizer state"
            )
        self.resumed_from = str(path)
        age = spec.optimizer_age or 0
        if age > 0:
            self._reset_weights_to_start()
        self.timings["load_checkpoint_s"] = time.perf_counter() - t0
        if age:
            log.warning(
                "optimizer state STALE: moments from %s, %d update(s) older than the weights of %s",
                path,
                age,
                spec.start_weights,
            )
            return {"optimizer_state": "stale", "optimizer_age": age}
        log.info("optimizer state restored exactly from %s (global step %d)", path, self.engine.global_steps)
        return {"optimizer_state": "restored", "optimizer_age": 0}

    def _reset_weights_to_start(self) -> None:
        """After loading an older snapshot: weights back to the spec's start weights, its moments kept."""
        import torch

        import pettingflow.training.model as M

        spec, module = self.spec, self.engine.module
        if spec.training.zero_stage == 3:
            raise ValueError(
                "a stale optimizer snapshot cannot be combined with newer weights under ZeRO-3; "
                "set training.save_optimizer_every=1 (or use ZeRO 0-2)"
            )
        with torch.no_grad():
            if spec.uses_lora:
                M.load_adapter_weights(module, spec.adapters_in or {})
            else:
                fresh = M.load_causal_lm(spec.init_model_dir, M.torch_dtype(self.dtype))
                module.load_state_dict(fresh.state_dict())
        refresh = getattr(self.engine.optimizer, "refresh_fp32_params", None)
        if refresh is not None:  # mixed precision: the fp32 master weights follow the module's weights
            refresh()

    def train(self) -> None:
        import torch

        import pettingflow.training.logprobs as L
        import pettingflow.training.model as M

        spec, algo, engine = self.spec, self.spec.algorithm, self.engine
        t0 = time.perf_counter()
        module = engine.module
        module.eval()
        # one epoch: no optimizer step precedes the first window, so its old log-probs are the current ones
        first_is_current = spec.training.epochs == 1 and not algo.use_sampler_logprobs
        # ZeRO-3 gathers each module's weights with a collective at every call, so all ranks must make the same
        # module calls: no prompt sharing (its forward count follows the rows' prompt groups) and the same number
        # of LM-head chunks on every rank
        sharded = spec.training.zero_stage == 3 and self.world_size > 1
        share = spec.training.share_prompts and not sharded
        chunk = spec.training.head_chunk_tokens if spec.training.head_at_loss_positions else None
        agree = max_over_ranks if sharded else None
        diff_sum, diff_n = 0.0, 0
        forwards_skipped = 0
        for w, slots in enumerate(self.my_slots):
            for mb in slots:
                if mb.adapter is not None:
                    M.activate_adapter(module, mb.adapter)
                if algo.use_sampler_logprobs:
                    mb.old_logprobs = mb.sampler_logprobs
                elif w == 0 and first_is_current:
                    mb.old_logprobs = None
                    forwards_skipped += 1  # fillers too: a forward each rank did not run
                else:
                    mb.old_logprobs = L.micro_batch_logprobs(module, mb, share, chunk, agree)
                    if not mb.is_padding:
                        valid = mb.loss_mask != 0
                        diff_sum += float((mb.old_logprobs - mb.sampler_logprobs).abs()[valid].sum())
                        diff_n += int(valid.sum())
                if algo.kl_coef > 0:
                    if spec.uses_lora:
                        with M.adapters_disabled(module):
                            mb.ref_logprobs = L.micro_batch_logprobs(module, mb, share, chunk, agree)
                    else:
                        mb.ref_logprobs = L.micro_batch_logprobs(self.reference, mb, share, chunk)
        self.timings["logprob_s"] = time.perf_counter() - t0

        acc = _Accumulator()
        acc.add("old_logprob_forwards_skipped", float(forwards_skipped), 0.0)  # over all ranks, not rank 0's
        engine.train()
        # transformers turns the KV cache off in checkpointed layers while training, and a shared prompt's
        # responses need that cache: the loss forward runs padded rows then (the log-prob passes above ran in
        # eval mode, where checkpointing is off, and shared their prompts)
        share = share and not spec.training.gradient_checkpointing
        t1 = time.perf_counter()
        steps = 0
        for epoch in range(spec.training.epochs):
            for w, (window, slots) in enumerate(zip(self.windows, self.my_slots, strict=True)):
                self._set_active_groups(window.adapter)
                scale = window.loss_scale()
                manual_norm = None
                current_is_old = first_is_current and epoch == 0 and w == 0
                for i, mb in enumerate(slots):
                    if mb.adapter is not None:
                        M.activate_adapter(module, mb.adapter)
                    loss, m = L.micro_batch_loss(
                        engine,
                        mb,
                        algo,
                        old_is_current=current_is_old,
                        share_prompts=share,
                        denominator=window.denominator,
                        head_chunk_tokens=chunk,
                        agree=agree,
                    )
                    engine.backward(loss * scale)
                    if i == len(slots) - 1 and spec.training.zero_stage == 0 and not self.engine.bfloat16_enabled():
                        # DeepSpeed reports no norm without ZeRO or mixed precision; grads are reduced here
                        grads = [p.grad for p in self.trainable if p.grad is not None]
                        manual_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
                        del grads  # else the list keeps this step's gradients alive into the next (4 B/param)
                    engine.step()
                    if not mb.is_padding:
                        self._record(acc, m, epoch, window, window.slots[self.rank][i], mb, share)
                        if "sampler_abs_diff_sum" in m:
                            diff_sum += m["sampler_abs_diff_sum"]
                            diff_n += int(m["model_tokens"])
                if self.rank == 0:  # once per step, on one rank: also a step whose rows were all skipped
                    for key in self._metric_keys(GRADIENT_METRICS, epoch, window.adapter):
                        acc.add(key, 0.0, 1.0)
                norm = engine.get_global_grad_norm()
                norm = manual_norm if norm is None else float(norm)
                if norm is not None and math.isfinite(norm):
                    acc.add("grad_norm", norm)
                    self._grad_norms.append(norm)
                steps += 1
        if diff_n:
            acc.add("sampler_logprob_abs_diff", diff_sum, diff_n)
        self.timings["train_s"] = time.perf_counter() - t1
        self.metrics.update(self._loss_metrics(acc, steps))

    def save_checkpoint(self) -> None:
        import torch.distributed as dist

        import pettingflow.training.model as M

        spec, engine = self.spec, self.engine
        t0 = time.perf_counter()
        ds_dir = self.out / DEEPSPEED_SUBDIR
        if spec.save_resume_state:
            self._save_deepspeed(ds_dir)
        if spec.training.zero_stage == 3:
            state = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=spec.uses_lora)
        else:
            state = engine.module.state_dict() if self.rank == 0 else None
        outputs: dict[str, Any] = {
            "deepspeed": str(ds_dir) if spec.save_resume_state else None,
            "model": None,
            "adapters": None,
        }
        if self.rank == 0:
            module = engine.module
            if spec.uses_lora:
                outputs["adapters"] = {}
                for agent in spec.agents:
                    folder = self.out / ADAPTERS_SUBDIR / agent
                    M.save_adapter(module, state, agent, folder)
                    outputs["adapters"][agent] = str(folder)
            else:
                M.save_full_model(module, state, self.out / MODEL_SUBDIR, spec.init_model_dir)
                outputs["model"] = str(self.out / MODEL_SUBDIR)
        dist.barrier()
        self.timings["save_s"] = time.perf_counter() - t0
        self.metrics["outputs"] = outputs
        self.metrics["optimizer_saved"] = spec.save_resume_state

    def _save_deepspeed(self, ds_dir: Path) -> None:
        """The optimizer snapshot (DeepSpeed checkpoint: fp32 weights, Adam moments, step count); every rank
        takes part (ZeRO shards are saved per rank)."""
        spec = self.spec
        client_state = {"policy": spec.policy, "specialization": spec.specialization.value, "agents": list(spec.agents)}
        self.engine.save_checkpoint(str(ds_dir), client_state=client_state, exclude_frozen_parameters=spec.uses_lora)

    def save_optimizer_snapshot(self, out_dir: str, weights_uri: str) -> dict[str, Any]:
        """Write the snapshot of the state the last update left into ``out_dir``/deepspeed, after that update
        returned (``training.optimizer_snapshot: background``): the flow commits it as ``optimizer-<policy>`` while
        it syncs, validates and collects the next rollouts. Refused when the engine no longer holds the weights
        of ``weights_uri`` (a failed update released it, or a later one changed it): a snapshot must match its update.
        """
        import torch.distributed as dist

        if self.engine is None or self.holds != weights_uri:
            raise RuntimeError(
                f"no optimizer snapshot for {weights_uri}: this rank holds {self.holds or 'no committed weights'}"
            )
        t0 = time.perf_counter()
        self._save_deepspeed(Path(out_dir) / DEEPSPEED_SUBDIR)
        dist.barrier()
        save_s = round(time.perf_counter() - t0, 3)
        return {"save_s": save_s, "global_steps": int(self.engine.global_steps), **self.release_memory()}

    def release_memory(self) -> dict[str, Any]:
        """Give the memory the allocator holds free back to the kernel after an update or a snapshot
        (``allocator.release_free_memory``: the rank's resident memory between updates is then what it holds, not
        the high-water mark of the longest batch so far). Returns what it released, for the metrics."""
        import psutil

        from pettingflow.allocator import release_free_memory

        me = psutil.Process()
        before, t0 = me.memory_info().rss, time.perf_counter()
        released_by = release_free_memory()
        after = me.memory_info().rss
        return {
            "release_memory_s": round(time.perf_counter() - t0, 3),
            "memory_released_by": released_by,
            "rss_mb_released": round((before - after) / 2**20),
            "rss_mb_after_release": round(after / 2**20),
        }

    def release(self) -> None:
        """Drop the model, engine and optimizer (the process group stays)."""
        self.engine = None
        self.reference = None
        self.client_optimizer = None
        self.trainable = []
        self.build_key = None
        self.holds = None
        gc.collect()

    def cleanup(self) -> None:
        self.my_slots = []
        self.release()

    # ------------------------------------------------------------------------------------------------ helpers
    def _check_rows(self) -> None:
        from pettingflow.training.data import BatchError

        spec = self.spec
        policies = sorted({s.policy_name for s in self.rows.samples})
        wrong = [p for p in policies if p != spec.policy]
        if wrong:
            raise BatchError(f"batch {spec.batch_uri} holds rows of policies {wrong}; this job updates {spec.policy!r}")
        if spec.uses_lora:
            unknown = sorted({s.agent_name for s in self.rows.samples} - set(spec.agents))
            if unknown:
                raise BatchError(
                    f"batch rows name agents {unknown} that have no adapter in this job (agents: {spec.agents})"
                )

    def _row_metrics(self) -> dict[str, Any]:
        spec, rows = self.spec, self.rows
        per_agent: dict[str, dict[str, Any]] = {}
        for name in spec.agents:
            per_agent[name] = {"rows": 0, "model_tokens": 0}
        for s in rows.samples:
            entry = per_agent.setdefault(s.agent_name, {"rows": 0, "model_tokens": 0})
            entry["rows"] += 1
            entry["model_tokens"] += s.model_tokens
            if s.lora_name is not None:
                entry.setdefault("lora_names", set()).add(s.lora_name)
        for entry in per_agent.values():
            if "lora_names" in entry:
                entry["lora_names"] = sorted(entry["lora_names"])
        return {
            "policy": spec.policy,
            "specialization": spec.specialization.value,
            "skipped": False,
            "rows_total": rows.total,
            "rows_used": len(rows.samples),
            "rows_dropped": rows.n_dropped,
            "rows_dropped_by_reason": rows.dropped_counts,
            "agents": per_agent,
            "num_processes": self.world_size,
            "zero_stage": spec.training.zero_stage,
            "dtype": spec.training.dtype,
            "epochs": spec.training.epochs,
            "old_logprobs": "sampler" if spec.algorithm.use_sampler_logprobs else "recomputed",
            "reference": (
                "none"
                if spec.algorithm.kl_coef <= 0
                else ("base_adapters_disabled" if spec.uses_lora else f"frozen:{spec.reference_dir}")
            ),
        }

    def _set_active_groups(self, active_adapter: str | None) -> None:
        """Only the window's adapter (or the single full-weight group) takes the next optimizer step."""
        for group in self.client_optimizer.param_groups:
            adapter = group.get("adapter")
            group["active"] = adapter is None or adapter == active_adapter

    def _record(
        self,
        acc: _Accumulator,
        m: dict[str, float],
        epoch: int,
        window: Any,
        samples: list[Any],
        mb: Any,
        share: bool,
    ) -> None:
        """Add one real micro-batch's metrics (its own means, ``micro_batch_loss``) as its part of its step's value.

        Why weighted: which rows make a micro-batch depends on the world size and ``micro_batch_size`` (each rank
        takes a share of every window), so a mean of micro-batch means would too. A step's value is over its
        whole window, as its gradient is: the loss terms (``AGG_MODE_METRICS``) weigh a micro-batch by its count in
        ``loss_agg_mode`` (model tokens for token-mean, rows for the seq modes) over the window's, the token
        diagnostics (clip fractions, ``approx_kl``, ``ratio_mean``, ``logprob_mean``) by its model tokens over the
        window's, so that the weights of a step's micro-batches sum to 1 over all ranks. ``loss`` and ``pg_loss``
        are divided by the whole window's denominator, as the gradient is (a row skipped for a zero advantage
        counts there with its loss, 0), and weighed 1 per step by ``train`` (a step of skipped rows only has loss
        0 and still counts). A reported metric is thus the mean over optimizer steps (per epoch, per adapter) of
        the step's value.
        """
        from pettingflow.rl.losses import loss_denominator

        mode = self.spec.algorithm.loss_agg_mode
        count = loss_denominator([s.model_tokens for s in samples], mode)
        count_share = count / window.trained_denominator  # the step's computed rows: shares that sum to 1
        token_share = sum(s.model_tokens for s in samples) / window.trained_tokens
        for key in (*LOSS_METRICS, "logprob_mean"):
            if key not in m:
                continue
            if key in GRADIENT_METRICS:
                value, weight = m[key] * count / window.denominator, 0.0
            elif key in AGG_MODE_METRICS:
                value, weight = m[key] * count_share, count_share
            else:
                value, weight = m[key] * token_share, token_share
            for name in self._metric_keys((key,), epoch, window.adapter):
                acc.add(name, value, weight)
        acc.add("model_tokens", m["model_tokens"], 0.0)
        acc.add("tokens", float(mb.tokens), 0.0)
        acc.add("computed_tokens", float(mb.computed_tokens(share)), 0.0)
        acc.add("micro_batches", 1.0, 0.0)

    @staticmethod
    def _metric_keys(keys: tuple[str, ...], epoch: int, adapter: str | None) -> list[str]:
        """Where a loss metric is accumulated: overall, for its epoch and, in L2, for its adapter."""
        scopes = ["", f"epoch{epoch}/"] + ([f"agent/{adapter}/"] if adapter is not None else [])
        return [scope + key for scope in scopes for key in keys]

    def _loss_metrics(self, acc: _Accumulator, steps: int) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        reduced = acc.reduce(self.world_size)
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
        norms = torch.tensor([max(self._grad_norms, default=0.0), rss_mb], dtype=torch.float64)
        if self.world_size > 1:
            norms = norms.to(collective_device())
            dist.all_reduce(norms, op=dist.ReduceOp.MAX)
            norms = norms.cpu()
        out: dict[str, Any] = {}
        epochs: dict[int, dict[str, float]] = defaultdict(dict)
        agents: dict[str, dict[str, float]] = defaultdict(dict)
        for key, (total, count) in reduced.items():
            if key in COUNT_METRICS:
                out[key] = round(total)
                continue
            value = total / count if count else 0.0
            if key.startswith("epoch"):
                e, name = key.split("/", 1)
                epochs[int(e[len("epoch") :])][name] = value
            elif key.startswith("agent/"):
                _, agent, name = key.split("/", 2)
                agents[agent][name] = value
            else:
                out[key] = value
        out["grad_norm_max"] = float(norms[0])
        out["max_rss_mb_per_rank"] = round(float(norms[1]))
        out["optimizer_steps"] = steps
        out["global_step"] = int(self.engine.global_steps)
        out["epoch_metrics"] = [epochs[e] for e in sorted(epochs)]
        for agent, values in agents.items():
            self.metrics["agents"].setdefault(agent, {}).update(values)
        train_s = self.timings.get("train_s", 0.0)
        out["tokens_per_s"] = round(out.get("tokens", 0) / train_s, 1) if train_s else None
        out["model_tokens_per_s"] = round(out.get("model_tokens", 0) / train_s, 1) if train_s else None
        # what the forward ran (a shared prompt once per group): the roofline's token count (steps/report.py)
        out["computed_tokens_per_s"] = round(out.get("computed_tokens", 0) / train_s, 1) if train_s else None
        out["step_s"] = round(train_s / steps, 3) if steps else None
        out["resumed_from"] = self.resumed_from
        return out

    def _write_metrics(self) -> None:
        self.metrics["timings"] = {k: round(v, 3) for k, v in self.timings.items()}
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / f".{METRICS_FILE}.tmp"
        tmp.write_text(json.dumps(self.metrics, indent=2, sort_keys=True, default=str))
        os.replace(tmp, self.out / METRICS_FILE)
