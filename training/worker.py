"""The update process of one policy: ``python -m pettingflow.training.worker --spec SPEC.json``.

Run as one process, or as N ranks under ``torch.distributed.run`` (gloo); ``launch.run_update`` does either.
The lifecycle is small and explicit (torchtune style)::

    setup -> load_checkpoint -> train -> save_checkpoint -> cleanup

- ``setup``: read the batch, drop untrainable rows (counted), plan the optimizer-step windows, initialise
  ``torch.distributed`` (gloo), load the policy (full weights, or base + one LoRA adapter per agent) and, when
  ``kl_coef > 0``, the reference; wrap the policy in a DeepSpeed engine (ZeRO stage and bf16 from the config,
  a client ``torch.optim.AdamW`` so no DeepSpeed op is JIT-compiled). An empty batch stops here: the job
  writes ``metrics.json`` with ``skipped: true`` and no weights.
- ``load_checkpoint``: with ``resume_dir`` (a previous job's ``deepspeed/`` folder), weights and optimizer
  state come from it, exactly.
- ``train``: old log-probs (recomputed with the current weights, or the sampler's when
  ``use_sampler_logprobs``) and reference log-probs (only when ``kl_coef > 0``) are computed once, then
  ``epochs`` PPO passes run over the windows with gradient accumulation and clipping.
- ``save_checkpoint``: ``deepspeed/`` (resume state), ``model/`` (full: HF safetensors + tokenizer files) or
  ``adapters/<agent>/`` (LoRA: peft folders), then ``metrics.json`` last: its presence means the job finished.

L2 (LoRA): every window (optimizer step) holds one agent's rows, and the optimizer skips the param groups of
all other adapters (``GroupMaskedAdamW``), so an adapter's weights and optimizer state change only on steps
made of its own agent's rows; an agent without rows keeps its adapter bit-identical.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import math
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from pettingflow.training.launch import METRICS_FILE, UpdateSpec

log = logging.getLogger("pettingflow.training.worker")

LOSS_METRICS = ("loss", "pg_loss", "clip_fraction", "dual_clip_fraction", "approx_kl", "ratio_mean", "entropy", "kl")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def ensure_dist_env() -> None:
    """Single-process defaults for the variables torch.distributed reads (torchrun sets them per rank)."""
    if "MASTER_PORT" not in os.environ:
        from pettingflow.training.launch import free_port

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


class _Accumulator:
    """Sums and counts of named metrics, reduced over ranks at the end (means of micro-batch values)."""

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
            t = torch.tensor([sums.get(k, 0.0) for k in keys] + [counts.get(k, 0.0) for k in keys], dtype=torch.float64)
            dist.all_reduce(t)
            n = len(keys)
            sums = dict(zip(keys, t[:n].tolist(), strict=True))
            counts = dict(zip(keys, t[n:].tolist(), strict=True))
        return {k: (sums[k], counts[k]) for k in sums}


class UpdateWorker:
    """One update job. ``run()`` executes the lifecycle and returns the metrics (rank 0 writes them)."""

    def __init__(self, spec: UpdateSpec):
        self.spec = spec
        self.out = Path(spec.out_dir)
        self.rank = _env_int("RANK", 0)
        self.world_size = _env_int("WORLD_SIZE", 1)
        self.engine: Any = None
        self.reference: Any = None
        self.windows: list[Any] = []
        self.my_slots: list[list[Any]] = []  # per window: this rank's gas MicroBatches
        self.rows: Any = None
        self.client_optimizer: Any = None
        self.trainable: list[Any] = []
        self.resumed_from: str | None = None
        self.metrics: dict[str, Any] = {}
        self.timings: dict[str, float] = {}
        self.skipped = False
        self._grad_norms: list[float] = []

    # ------------------------------------------------------------------------------------------------ lifecycle
    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            self.setup()
            if not self.skipped:
                self.load_checkpoint()
                self.train()
                self.save_checkpoint()
        finally:
            self.cleanup()
        self.metrics["duration_s"] = round(time.perf_counter() - started, 3)
        if self.rank == 0:
            self._write_metrics()
        return self.metrics

    def setup(self) -> None:
        t0 = time.perf_counter()
        spec = self.spec
        from pettingflow.training.data import read_batch, samples_from_table

        table = read_batch(spec.batch_uri, spec.storage_options)
        self.rows = samples_from_table(table, spec.training.max_seq_len)
        self._check_rows()
        self.metrics.update(self._row_metrics())
        if not self.rows.samples:
            self.skipped = True
            self.metrics.update(skipped=True, reason="no trainable rows in the batch", outputs=None)
            log.warning("batch %s has no trainable rows: skipping the update", spec.batch_uri)
            return

        import deepspeed
        import torch

        from pettingflow.training import model as M
        from pettingflow.training.data import collate, filler, plan_windows

        torch.manual_seed(spec.seed)
        ensure_dist_env()
        disable_shm_comm()
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend=dist_backend())
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()

        dtype = M.torch_dtype(spec.training.dtype)
        base = M.load_causal_lm(spec.init_model_dir, dtype)
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
        # fused=True: torch's single-kernel CPU/CUDA AdamW, ~7x faster than foreach on CPU here, no JIT build
        self.client_optimizer = M.GroupMaskedAdamW(
            groups,
            lr=spec.training.lr,
            weight_decay=spec.training.weight_decay,
            betas=(0.9, 0.999),
            eps=1e-8,
            fused=True,
        )
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=self.client_optimizer, config=self.deepspeed_config()
        )

        device = self.engine.device
        if self.reference is not None and not isinstance(self.reference, str):
            self.reference.to(device)
        self.windows = plan_windows(
            self.rows.samples,
            spec.training.micro_batch_size,
            spec.training.gradient_accumulation_steps,
            self.world_size,
            by_adapter=spec.uses_lora,
        )
        for window in self.windows:
            mine = window.slots[self.rank]
            real = next(s for s in window.slots[0] if s is not None)
            self.my_slots.append(
                [
                    (collate(s, adapter=window.adapter) if s is not None else filler(real, window.adapter)).to(device)
                    for s in mine
                ]
            )
        self.timings["setup_s"] = time.perf_counter() - t0
        log.info(
            "rank %d/%d: %d rows, %d windows, %d micro-steps per window, %s",
            self.rank,
            self.world_size,
            len(self.rows.samples),
            len(self.windows),
            spec.training.gradient_accumulation_steps,
            "LoRA " + ",".join(spec.agents) if spec.uses_lora else "full weights",
        )

    def deepspeed_config(self) -> dict[str, Any]:
        t = self.spec.training
        zero: dict[str, Any] = {"stage": t.zero_stage}
        if t.zero_stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = True
        return {
            "train_micro_batch_size_per_gpu": t.micro_batch_size,
            "gradient_accumulation_steps": t.gradient_accumulation_steps,
            "train_batch_size": t.micro_batch_size * t.gradient_accumulation_steps * self.world_size,
            "gradient_clipping": t.max_grad_norm,
            "zero_optimization": zero,
            "bf16": {"enabled": t.dtype == "bf16"},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }

    def load_checkpoint(self) -> None:
        spec = self.spec
        if not spec.resume_dir:
            return
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
        self.timings["load_checkpoint_s"] = time.perf_counter() - t0
        log.info("resumed from %s (global step %d)", path, self.engine.global_steps)

    def train(self) -> None:
        import torch

        from pettingflow.training import model as M

        spec, algo, engine = self.spec, self.spec.algorithm, self.engine
        t0 = time.perf_counter()
        module = engine.module
        module.eval()
        diff_sum, diff_n = 0.0, 0
        for slots in self.my_slots:
            for mb in slots:
                if mb.adapter is not None:
                    M.activate_adapter(module, mb.adapter)
                if algo.use_sampler_logprobs:
                    mb.old_logprobs = mb.sampler_logprobs
                else:
                    mb.old_logprobs = M.micro_batch_logprobs(module, mb)
                    if not mb.is_padding:
                        valid = mb.loss_mask != 0
                        diff_sum += float((mb.old_logprobs - mb.sampler_logprobs).abs()[valid].sum())
                        diff_n += int(valid.sum())
                if algo.kl_coef > 0:
                    if spec.uses_lora:
                        with M.adapters_disabled(module):
                            mb.ref_logprobs = M.micro_batch_logprobs(module, mb)
                    else:
                        mb.ref_logprobs = M.micro_batch_logprobs(self.reference, mb)
        self.timings["logprob_s"] = time.perf_counter() - t0

        acc = _Accumulator()
        if diff_n:
            acc.add("sampler_logprob_abs_diff", diff_sum, diff_n)
        engine.train()
        t1 = time.perf_counter()
        steps = 0
        for epoch in range(spec.training.epochs):
            for window, slots in zip(self.windows, self.my_slots, strict=True):
                self._set_active_groups(window.adapter)
                scale = window.loss_scale()
                manual_norm = None
                for i, mb in enumerate(slots):
                    if mb.adapter is not None:
                        M.activate_adapter(module, mb.adapter)
                    loss, m = M.micro_batch_loss(engine, mb, algo)
                    engine.backward(loss * scale)
                    if i == len(slots) - 1 and spec.training.zero_stage == 0 and spec.training.dtype == "fp32":
                        # DeepSpeed does not report the norm for plain fp32 without ZeRO; grads are reduced here
                        grads = [p.grad for p in self.trainable if p.grad is not None]
                        manual_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
                    engine.step()
                    if not mb.is_padding:
                        self._record(acc, m, epoch, window.adapter, mb)
                norm = engine.get_global_grad_norm()
                norm = manual_norm if norm is None else float(norm)
                if norm is not None and math.isfinite(norm):
                    acc.add("grad_norm", norm)
                    self._grad_norms.append(norm)
                steps += 1
        self.timings["train_s"] = time.perf_counter() - t1
        self.metrics.update(self._loss_metrics(acc, steps))

    def save_checkpoint(self) -> None:
        import torch.distributed as dist

        from pettingflow.training import model as M

        spec, engine = self.spec, self.engine
        t0 = time.perf_counter()
        ds_dir = self.out / "deepspeed"
        client_state = {
            "policy": spec.policy,
            "specialization": spec.specialization.value,
            "agents": list(spec.agents),
        }
        if spec.save_resume_state:
            engine.save_checkpoint(str(ds_dir), client_state=client_state, exclude_frozen_parameters=spec.uses_lora)
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
                    folder = self.out / "adapters" / agent
                    M.save_adapter(module, state, agent, folder)
                    outputs["adapters"][agent] = str(folder)
            else:
                M.save_full_model(module, state, self.out / "model", spec.init_model_dir)
                outputs["model"] = str(self.out / "model")
        dist.barrier()
        self.timings["save_s"] = time.perf_counter() - t0
        self.metrics["outputs"] = outputs

    def cleanup(self) -> None:
        self.engine = None
        self.reference = None
        self.my_slots = []
        self.client_optimizer = None
        self.trainable = []
        gc.collect()

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
            group["lr"] = self.spec.training.lr

    def _record(self, acc: _Accumulator, m: dict[str, float], epoch: int, adapter: str | None, mb: Any) -> None:
        for key in (*LOSS_METRICS, "logprob_mean"):
            if key in m:
                acc.add(key, m[key])
                acc.add(f"epoch{epoch}/{key}", m[key])
                if adapter is not None:
                    acc.add(f"agent/{adapter}/{key}", m[key])
        acc.add("model_tokens", m["model_tokens"], 0.0)
        acc.add("tokens", float(mb.tokens), 0.0)
        acc.add("micro_batches", 1.0, 0.0)

    def _loss_metrics(self, acc: _Accumulator, steps: int) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        reduced = acc.reduce(self.world_size)
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
        norms = torch.tensor([max(self._grad_norms, default=0.0), rss_mb], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(norms, op=dist.ReduceOp.MAX)
        out: dict[str, Any] = {}
        epochs: dict[int, dict[str, float]] = defaultdict(dict)
        agents: dict[str, dict[str, float]] = defaultdict(dict)
        for key, (total, count) in reduced.items():
            if key in ("model_tokens", "tokens", "micro_batches"):
                out[key] = int(total)
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
        out["step_s"] = round(train_s / steps, 3) if steps else None
        out["resumed_from"] = self.resumed_from
        return out

    def _write_metrics(self) -> None:
        self.metrics["timings"] = {k: round(v, 3) for k, v in self.timings.items()}
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / f".{METRICS_FILE}.tmp"
        tmp.write_text(json.dumps(self.metrics, indent=2, sort_keys=True, default=str))
        os.replace(tmp, self.out / METRICS_FILE)


def run_worker(spec: UpdateSpec) -> dict[str, Any]:
    """Run the lifecycle in this process (tests, or under torchrun via ``main``)."""
    ensure_dist_env()
    return UpdateWorker(spec).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pettingflow.training.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True, help="UpdateSpec JSON file (written by launch.run_update)")
    args = parser.parse_args(argv)
    rank = _env_int("RANK", 0)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    spec = UpdateSpec.model_validate_json(Path(args.spec).read_text())
    try:
        metrics = run_worker(spec)
    finally:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # pragma: no cover - best effort at exit
            pass
    if rank == 0:
        summary = {k: metrics.get(k) for k in ("skipped", "rows_used", "loss", "grad_norm", "duration_s")}
        log.info("done: %s", json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
