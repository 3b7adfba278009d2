"""Learner memory per rank: ZeRO-0/2/3 x gradient checkpointing x optimizer offload, 2 ranks, sequence 1024.

    .venv/bin/python -m bench.memory --size small          # 10 configurations
    .venv/bin/python -m bench.memory                       # --size full (290M params, ~16 GiB): an idle machine
    .venv/bin/python -m bench.memory --size small --zero 0 3 --checkpointing off --offload off
    .venv/bin/python -m bench.memory --size small --offload off --ds zero_optimization.reduce_bucket_size=262144
    .venv/bin/python -m bench.memory --show docs/results/bench/memory-20261125-small.json   # re-print a run

Why: ZeRO stages, gradient checkpointing and optimizer offload are settings of ``training`` (``zero_stage``,
``gradient_checkpointing`` with ``head_chunk_tokens``, ``offload_optimizer``); this measures what each one
does to the memory of one learner rank, with the DeepSpeed config ``training/worker.py`` builds for them
(``deepspeed_config``), so that a setting is chosen on figures. Goals: ZeRO-3's model + gradient + optimizer
memory per rank <= 0.55 x ZeRO-0's; activation memory with checkpointing <= 0.5 x without.

Model: a randomly initialised Llama built locally (``transformers.LlamaConfig`` / ``LlamaForCausalLM``, nothing
downloaded), saved once in fp32 into a temp folder; ``--size`` picks the shape (``SIZES``), ``--layers`` etc.
override it. Training dtype fp32 by default (``--dtype bf16`` possible, what ``training.dtype: auto`` picks on
an AVX-512 CPU or a GPU): in fp32 the bytes per parameter read off plainly (weights and gradients 4, Adam
moments 8); in bf16 DeepSpeed keeps an fp32 master copy beside the bf16 weights at every stage (ZeRO-0:
``FP16_UnfusedOptimizer``).

"Checkpointing on" checkpoints the decoder layers (``gradient_checkpointing``) and computes the LM head, log-softmax
and entropy in chunks of ``--head-chunk`` tokens recomputed in the backward (``head_chunk_tokens``, default 256):
with the layers checkpointed, the vocabulary-wide logits are the largest activation left (``--head-chunk 0``: the
layers only).

Each configuration runs in fresh processes: ``torch.distributed.run`` with 2 ranks (gloo) of this script's
``--rank-worker`` mode, each of which uses ``training.worker.UpdateWorker`` as the learner does
(``read_rows``, ``prepare`` = build the model + DeepSpeed engine, ``plan``, ``train``; no checkpoint is saved).
Batch: 4 rows of ``--seq-len`` tokens (64 prompt + the rest response, random token ids, every response
token trained, sampler log-probs ~ -log(vocab) used as the old log-probs, no KL reference, no shared
prompts), ``micro_batch_size=1``, ``mini_batch_size=4`` (so each rank runs 2 micro-batches per optimizer
step, gradient accumulation 2) and ``epochs=2``: 2 optimizer steps, 4 forward/backward passes per rank.

Measured per rank (the table shows the larger of the two ranks; the JSON keeps both):

- **state** (model + gradients + optimizer), at the last backward of the second optimizer step, just before
  that step (weights, complete gradients and Adam moments are all live then, activations are freed):
  ``alloc`` = the bytes of every live torch tensor's storage (``gc.get_objects()``, plus each leaf's
  ``.grad``, deduplicated by storage address); this counts allocated buffers in full, as a GPU would hold
  them, whether touched or not. ``resident`` = the growth of the process's resident memory (VmRSS) from
  before the model was loaded (torch, DeepSpeed and the process group already initialised) to that point:
  what the CPU actually holds (an untouched part of a buffer is not resident).
- **activations**: for the last micro-batch (gradient buffers and Adam moments already exist, so nothing
  persistent is allocated during it), the peak resident memory during its forward (+ loss) and during its
  forward + backward, minus the resident memory just before its forward. The peak is the kernel's VmHWM,
  reset right before the forward by writing 5 to ``/proc/self/clear_refs`` (exact, no sampling).
  ZeRO-3's parameter gathers and the reduce bucket ZeRO-2 allocates in every backward count here too (they
  are working memory of the pass).
- **peak RSS**: ``ru_maxrss`` of the rank over its whole life (includes loading the full model before
  DeepSpeed partitions it: the worker does not build under ``zero.Init``).

The ranks run with glibc malloc (no tcmalloc preload) and ``MALLOC_MMAP_THRESHOLD_=131072``: every block
of 128 KiB or more is its own mapping and goes back to the kernel when freed, so resident memory follows the
live tensors instead of the allocator's free lists (this makes the passes slower; no time is reported
beyond each configuration's wall time). Torch uses 1 thread per rank.

Optimizer offload on a CPU-only machine moves host memory to host memory: it can only cost memory here (the
offloaded copies); its saving exists on a GPU. ZeRO-0 with offload is refused
by ``TrainingSettings`` (offload needs ZeRO), and those rows say so. A configuration that fails records the
error's key line in its row; the run goes on. ``--ds KEY=VALUE`` overrides a DeepSpeed config key
(dotted path) on top of the worker's config, to try a setting before changing the worker.

Output: progress per configuration, the table, the two ratios, and the raw numbers in
``docs/results/bench/memory-<date>-<size>[-bf16][-ds].json`` (``--show`` re-prints one). Memory figures do not
depend on the machine's load, so this bench does not wait for test sessions (``--wait`` to wait anyway); it
does add two ranks' worth of memory to whatever else runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from bench import common
from pettingflow.hardware import cpu_model

GIB = 1024**3
RESULTS = common.REPO / "docs" / "results" / "bench"
PROMPT_LEN = 64
ROWS = 4  # 2 ranks x 2 micro-batches of 1 row per optimizer step
MMAP_THRESHOLD = 131072
SUMMARY_KEYS = (
    "state_alloc",
    "state_resident",
    "optimizer_state_alloc",
    "other_alloc",
    "act_forward",
    "act_peak",
    "max_rss",
)

# Llama shapes: tied embeddings (like SmolLM2), multi-head attention (kv heads = heads), head size 64.
SIZES: dict[str, dict[str, int]] = {
    # 29.5M params: small enough for all 10 configurations on a small CPU machine beside other work
    "small": {"layers": 8, "hidden": 512, "intermediate": 1376, "heads": 8, "vocab": 8192},
    # 289.7M params: ZeRO-0 fp32 holds 20 B/param (5.4 GiB) per rank before activations and libraries, so the
    # 2 ranks need an otherwise idle machine
    "full": {"layers": 20, "hidden": 1024, "intermediate": 2816, "heads": 16, "vocab": 32000},
}


@dataclass(frozen=True)
class Case:
    zero: int
    checkpointing: bool
    offload: bool

    @property
    def name(self) -> str:
        return (
            f"ZeRO-{self.zero} ckpt={'on' if self.checkpointing else 'off'} offload={'on' if self.offload else 'off'}"
        )


# ------------------------------------------------------------------------------------------------ memory probes
def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss() -> int:
    return _status_bytes("VmRSS")


def rss_split() -> dict[str, int]:
    return {field: _status_bytes(field) for field in ("VmRSS", "RssAnon", "RssFile")}


def hwm() -> int:
    return _status_bytes("VmHWM")


def reset_hwm() -> None:
    """Set the peak resident memory (VmHWM) back to the current resident memory (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def live_tensor_bytes(module: Any = None, optimizer: Any = None) -> dict[str, int]:
    """Bytes of all live tensor storages (deduplicated by address), split into the storages of ``module``'s
    parameters (ZeRO-3: their ``ds_tensor`` partitions), of their ``.grad``, of ``optimizer``'s state (Adam
    moments), and the rest (DeepSpeed's master copies, gradient partitions and buckets, anything else)."""
    import torch

    gc.collect()
    storages: dict[int, int] = {}

    def add(t: Any, into: dict[int, int]) -> None:
        if not isinstance(t, torch.Tensor) or t.is_meta or t.layout != torch.strided:
            return
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr:
            into[ptr] = max(into.get(ptr, 0), st.nbytes())

    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            add(obj, storages)
            if obj.is_leaf:
                add(obj.grad, storages)
        except Exception:  # exotic objects (proxies, half-built tensors): not ours to count
            continue
    params: dict[int, int] = {}
    grads: dict[int, int] = {}
    moments: dict[int, int] = {}
    for p in module.parameters() if module is not None else ():
        add(p, params)
        add(getattr(p, "ds_tensor", None), params)
        add(p.grad, grads)
    for state in optimizer.state.values() if optimizer is not None else ():
        for value in state.values():
            add(value, moments)
    named = {**params, **grads, **moments}
    return {
        "all": sum(storages.values()),
        "params": sum(params.values()),
        "grads": sum(grads.values()),
        "optimizer_state": sum(moments.values()),
        "other": sum(v for k, v in storages.items() if k not in named),
    }


class Probe:
    """Wraps one engine's ``forward``, ``backward`` and ``step`` (instance attributes, so ``train()`` runs
    unchanged) and records resident memory around every micro-batch."""

    def __init__(self, engine: Any, optimizer: Any):
        self.records: list[dict[str, Any]] = []
        fwd, bwd, step = engine.forward, engine.backward, engine.step

        def forward(*args: Any, **kwargs: Any) -> Any:
            self.records.append({"rss_before": rss(), "t0": time.perf_counter()})
            reset_hwm()
            return fwd(*args, **kwargs)

        def backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
            rec = self.records[-1]
            rec["hwm_forward"] = hwm()
            out = bwd(loss, *args, **kwargs)
            rec["hwm_forward_backward"] = hwm()
            rec["rss_split_after_backward"] = rss_split()
            rec["rss_after_backward"] = rec["rss_split_after_backward"]["VmRSS"]
            rec["pass_s"] = time.perf_counter() - rec.pop("t0")
            rec["tensor_bytes"] = live_tensor_bytes(engine.module, optimizer)
            return out

        def step_(*args: Any, **kwargs: Any) -> Any:
            out = step(*args, **kwargs)
            self.records[-1]["rss_after_step"] = rss()
            return out

        engine.forward, engine.backward, engine.step = forward, backward, step_


# ------------------------------------------------------------------------------------------------ rank worker
def rank_worker(job_path: str) -> int:
    """One rank under torch.distributed.run: build, train 2 steps, measure, write ``rank<r>.json``."""
    import logging

    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import deepspeed
    import torch.distributed as dist

    from pettingflow.training.launch import UpdateSpec
    from pettingflow.training.worker import UpdateWorker, disable_shm_comm, dist_backend, ensure_dist_env

    job = json.loads(Path(job_path).read_text())
    overrides: dict[str, Any] = job["ds_overrides"]

    class BenchWorker(UpdateWorker):
        def deepspeed_config(self) -> dict[str, Any]:
            config = super().deepspeed_config()
            for key, value in overrides.items():
                node = config
                *parents, leaf = key.split(".")
                for p in parents:
                    node = node.setdefault(p, {})
                node[leaf] = value
            self.ds_config = config
            return config

    ensure_dist_env()
    disable_shm_comm()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend=dist_backend())
    # what build() imports on first use, before the baseline: its code is resident memory, not the model's state
    import transformers.models.llama.modeling_llama  # noqa: F401

    import pettingflow.training.model  # noqa: F401

    rank = dist.get_rank()
    spec = UpdateSpec.model_validate(job["spec"])
    worker = BenchWorker(spec)
    worker.read_rows()
    gc.collect()
    baseline_split = rss_split()
    baseline = baseline_split["VmRSS"]
    t0 = time.perf_counter()
    worker.prepare()
    build_s = time.perf_counter() - t0
    built = rss()
    worker.plan()
    probe = Probe(worker.engine, worker.client_optimizer)
    t1 = time.perf_counter()
    worker.train()
    train_s = time.perf_counter() - t1
    recs = probe.records
    last = recs[-1]
    out = {
        "rank": rank,
        "params": sum(getattr(p, "ds_numel", p.numel()) for p in worker.engine.module.parameters()),
        "baseline_rss": baseline,
        "built_rss": built,
        "state_alloc": last["tensor_bytes"]["all"],
        "state_resident": last["rss_after_backward"] - baseline,
        "optimizer_state_alloc": last["tensor_bytes"]["optimizer_state"],
        "other_alloc": last["tensor_bytes"]["other"],
        "rss_split_baseline": baseline_split,
        "rss_split_last_backward": last["rss_split_after_backward"],
        "act_forward": last["hwm_forward"] - last["rss_before"],
        "act_peak": last["hwm_forward_backward"] - last["rss_before"],
        "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "build_s": round(build_s, 2),
        "train_s": round(train_s, 2),
        "micro_steps": recs,
        "ds_config": getattr(worker, "ds_config", None),
        "optimizer": type(worker.engine.optimizer).__name__,
        "loss": worker.metrics.get("loss"),
        "epoch_metrics": worker.metrics.get("epoch_metrics"),
        "grad_norms": worker._grad_norms,
    }
    (Path(job_path).parent / f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    worker.cleanup()
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------------ setup
def save_model(folder: str, shape_json: str) -> int:
    """A random Llama of ``shape`` (fp32) in ``folder``; run in its own process so the parent stays small."""
    import torch
    from transformers import LlamaForCausalLM

    shape = json.loads(shape_json)
    torch.manual_seed(0)
    config = common.random_llama_config(shape)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    path = Path(folder)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    print(json.dumps({"params": sum(p.numel() for p in model.parameters())}))
    return 0


def training_settings(case: Case, args: Any) -> dict[str, Any]:
    return {
        "num_processes": 2,
        "zero_stage": case.zero,
        "dtype": args.dtype,
        "micro_batch_size": 1,
        "mini_batch_size": ROWS,
        "epochs": 2,
        "lr": 1e-5,
        "max_seq_len": args.seq_len,
        "share_prompts": False,
        "gradient_checkpointing": case.checkpointing,
        "head_chunk_tokens": args.head_chunk if case.checkpointing else 0,
        "offload_optimizer": case.offload,
        "malloc": "system",
    }


def key_line(text: str) -> str:
    """The failing rank's exception line (``[rankN]: SomeError: ...``, the last one), else a SIGKILL note or
    the last error-looking line of the log."""
    exc = re.compile(r"^(\[rank\d+\]):\s?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b.*)$")
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    found = [m for m in map(exc.match, lines) if m]
    if found:
        return f"{found[-1].group(2)[:300]} ({found[-1].group(1)[1:-1]})"
    if re.search(r"exitcode\s*:\s*-9\b", text):
        return "a rank was killed (SIGKILL: out of memory?)"
    for line in reversed(lines):
        if "Error" in line or "Exception" in line:
            return line.strip()[-300:]
    return lines[-1][-300:] if lines else "no output"


def run_case(case: Case, args: Any, model: Path, batch: Path, tmp: Path) -> dict[str, Any]:
    """One configuration in 2 fresh rank processes; returns its row (numbers or an error)."""
    from pydantic import ValidationError

    from pettingflow.configs.settings import TrainingSettings
    from pettingflow.processes import free_port
    from pettingflow.training.launch import UpdateSpec

    row: dict[str, Any] = {"zero": case.zero, "checkpointing": case.checkpointing, "offload": case.offload}
    try:
        training = TrainingSettings(**training_settings(case, args))
    except ValidationError as exc:
        row["error"] = "refused by TrainingSettings: " + exc.errors()[0]["msg"].removeprefix("Value error, ")
        row["expected_refusal"] = True
        return row
    folder = tmp / f"z{case.zero}-c{int(case.checkpointing)}-o{int(case.offload)}"
    folder.mkdir()
    spec = UpdateSpec(
        batch_uri=str(batch),
        policy="shared",
        out_dir=str(folder / "out"),
        init_model_dir=str(model),
        training=training,
        algorithm={"use_sampler_logprobs": True, "kl_coef": 0.0},
        save_resume_state=False,
    )
    job = folder / "job.json"
    job.write_text(json.dumps({"spec": spec.model_dump(mode="json"), "ds_overrides": args.ds_overrides}))
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        "--module",  # each rank runs `python -m bench.memory` (cwd: the repo root)
        "bench.memory",
        "--rank-worker",
        str(job),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.update(MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), OMP_NUM_THREADS="1")  # torchrun sets the rank variables
    env.pop("LD_PRELOAD", None)
    log_path = folder / "ranks.log"
    started = time.perf_counter()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=common.REPO,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this Popen started (torchrun and its 2 ranks)
            proc.wait()
            rc = None
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    row["wall_s"] = round(time.perf_counter() - started, 1)
    ranks = [folder / f"rank{r}.json" for r in range(2)]
    if rc != 0 or not all(p.is_file() for p in ranks):
        text = log_path.read_text(errors="replace")
        row["error"] = f"timed out after {args.timeout_s} s" if rc is None else key_line(text)
        row["log_tail"] = text[-6000:]
        return row
    per_rank = [json.loads(p.read_text()) for p in ranks]
    row["ranks"] = per_rank
    for key in SUMMARY_KEYS:
        row[key] = max(r[key] for r in per_rank)
    row["optimizer"] = per_rank[0]["optimizer"]
    row["train_s"] = max(r["train_s"] for r in per_rank)
    return row


def gib(value: Any) -> Any:
    return value / GIB if isinstance(value, int | float) else "-"


def ratio(rows: list[dict[str, Any]], key: str, num: tuple[int, bool, bool], den: tuple[int, bool, bool]) -> float:
    by = {(r["zero"], r["checkpointing"], r["offload"]): r for r in rows}
    a, b = by.get(num, {}).get(key), by.get(den, {}).get(key)
    return a / b if a is not None and b else float("nan")


def goal_line(name: str, value: float, goal: float) -> str:
    if value != value:
        return f"{name}: not measured (a configuration is missing or failed)"
    return f"{name}: {value:.3f}; goal <= {goal}: {'OK' if value <= goal else 'ABOVE GOAL'}"


def parse_overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, _, raw = item.partition("=")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 2e7 -> 20000000 (DeepSpeed wants integer sizes)
        out[key] = value
    return out


def report(record: dict[str, Any]) -> dict[str, float]:
    """Print the table and the goal ratios of a run's record; returns the ratios."""
    rows, params, cpu = record["configs"], record["params"], record["cpu"]
    stages = sorted({r["zero"] for r in rows})
    table = []
    for r in rows:
        name = f"ZeRO-{r['zero']}  {'on ' if r['checkpointing'] else 'off'}   {'on ' if r['offload'] else 'off'}"
        if r.get("expected_refusal"):
            table.append((name, *["-"] * 8, "n/a: TrainingSettings refuses it"))
        elif "error" in r:
            table.append((name, *["-"] * 8, r["error"][:70]))
        else:
            table.append(
                (
                    name,
                    gib(r["state_alloc"]),
                    r["state_alloc"] / params,
                    gib(r["optimizer_state_alloc"]),
                    gib(r["other_alloc"]),
                    gib(r["state_resident"]),
                    gib(r["act_forward"]),
                    gib(r["act_peak"]),
                    gib(r["max_rss"]),
                    f"{r['wall_s']:.0f}",
                )
            )
    common.print_table(
        [
            "config  ckpt  offload",
            "state alloc",
            "B/param",
            "Adam",
            "other",
            "state resident",
            "act fwd",
            "act fwd+bwd",
            "peak RSS",
            "wall s / error",
        ],
        table,
        title=f"GiB per rank (max of 2 ranks), {params / 1e6:.1f}M params, {record['dtype']}, "
        f"seq {record['seq_len']}; {cpu}",
    )
    print(
        "state alloc: live tensor storages before the 2nd optimizer step (B/param: per model parameter), of them "
        "Adam moments and 'other' (not a parameter, .grad or moment: master copies, gradient partitions and "
        "buckets); state resident: VmRSS growth from before the model load to then; act: peak VmRSS of the last "
        "micro-batch's forward (+loss) and forward+backward over VmRSS before it; peak RSS: ru_maxrss"
    )
    state_alloc = ratio(rows, "state_alloc", (3, False, False), (0, False, False))
    state_res = ratio(rows, "state_resident", (3, False, False), (0, False, False))
    ratios = {
        "zero3_over_zero0_state_alloc": state_alloc,
        "zero3_over_zero0_state_resident": state_res,
    }
    print(goal_line("ZeRO-3 / ZeRO-0 model+grad+optimizer, allocated (ckpt off, offload off)", state_alloc, 0.55))
    print(goal_line("ZeRO-3 / ZeRO-0 model+grad+optimizer, resident (ckpt off, offload off)", state_res, 0.55))
    for z in stages:
        value = ratio(rows, "act_peak", (z, True, False), (z, False, False))
        ratios[f"zero{z}_act_ckpt_over_no_ckpt"] = value
        print(goal_line(f"ZeRO-{z} activations (fwd+bwd peak) checkpointing / none (offload off)", value, 0.5))
    if record.get("ds_overrides"):
        print(f"DeepSpeed config overrides: {record['ds_overrides']}")
    chunk = record.get("head_chunk_tokens", 0)  # runs recorded before the key: the decoder layers only
    print(
        f"checkpointing on = decoder layers checkpointed + LM head in chunks of {chunk} tokens"
        if chunk
        else "checkpointing on = decoder layers checkpointed (LM head all at once)"
    )
    print(f"total {record['total_s'] / 60:.1f} min", flush=True)
    return ratios


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-worker"]:
        return rank_worker(argv[1])
    if argv[:1] == ["--save-model"]:
        return save_model(argv[1], argv[2])
    parser = argparse.ArgumentParser(
        prog="python -m bench.memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    for dim in ("layers", "hidden", "intermediate", "heads", "vocab"):
        parser.add_argument(f"--{dim}", type=int, help=f"override the size's {dim}")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per row (64 prompt + response)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--zero", type=int, nargs="+", default=[0, 2, 3], choices=(0, 1, 2, 3))
    parser.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=("off", "on"))
    parser.add_argument("--offload", nargs="+", default=["off", "on"], choices=("off", "on"))
    parser.add_argument(
        "--head-chunk",
        type=int,
        default=256,
        help="training.head_chunk_tokens of the checkpointing-on rows (0: the decoder layers only)",
    )
    parser.add_argument("--ds", action="append", default=[], metavar="KEY=VALUE", help="DeepSpeed config override")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per configuration")
    parser.add_argument(
        "--json", type=Path, help="raw results path (default docs/results/bench/memory-DATE-SIZE[-bf16][-ds].json)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp folder (model, batch, rank logs)")
    parser.add_argument("--wait", action="store_true", help="wait while a pytest session runs before starting")
    parser.add_argument("--show", type=Path, metavar="JSON", help="print the table of a saved run and exit")
    args = parser.parse_args(argv)
    if args.show:
        report(json.loads(args.show.read_text()))
        return 0
    common.setup_logging()
    if args.wait:
        common.wait_for_quiet()
    args.ds_overrides = parse_overrides(args.ds)
    shape = dict(SIZES[args.size])
    for dim in shape:
        if getattr(args, dim) is not None:
            shape[dim] = getattr(args, dim)
    label = args.size if shape == SIZES[args.size] else "custom"
    cases = [Case(z, c == "on", o == "on") for z in args.zero for c in args.checkpointing for o in args.offload]
    cpu = cpu_model()
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with common.temp_dir("memory", keep=args.keep) as tmp:
        model = tmp / "model"
        out = subprocess.run(
            [sys.executable, "-m", "bench.memory", "--save-model", str(model), json.dumps(shape)],
            cwd=common.REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        params = json.loads(out.stdout.strip().splitlines()[-1])["params"]
        batch = tmp / "batch-shared.parquet"
        # sampler log-probs ~ a random model's: ratios near 1, unclipped
        common.write_random_batch(
            batch,
            ROWS,
            args.seq_len,
            PROMPT_LEN,
            shape["vocab"],
            sampler_logprob=-math.log(shape["vocab"]),
            run_id="bench-memory",
        )
        print(
            f"{cpu}; random Llama {label} {shape} = {params / 1e6:.1f}M params, {args.dtype}, 2 ranks (gloo), "
            f"{ROWS} rows x {args.seq_len} tokens, micro-batch 1, gradient accumulation 2, 2 optimizer steps, "
            f"1 torch thread per rank; checkpointing on = layers + LM head in chunks of {args.head_chunk} tokens; "
            f"DeepSpeed overrides {args.ds_overrides or 'none'}",
            flush=True,
        )
        for i, case in enumerate(cases, 1):
            print(f"[{i}/{len(cases)}] {case.name} ...", flush=True)
            row = run_case(case, args, model, batch, tmp)
            rows.append(row)
            if "error" in row:
                print(f"    {row['error']}", flush=True)
            else:
                print(
                    f"    {row['wall_s']:.0f} s: state {gib(row['state_alloc']):.2f} GiB allocated / "
                    f"{gib(row['state_resident']):.2f} GiB resident, activations {gib(row['act_peak']):.2f} GiB, "
                    f"peak RSS {gib(row['max_rss']):.2f} GiB ({row['optimizer']})",
                    flush=True,
                )
    total_s = time.perf_counter() - started
    record: dict[str, Any] = {
        "cpu": cpu,
        "versions": {name: version(name) for name in ("torch", "deepspeed", "transformers")},
        "size": label,
        "shape": shape,
        "params": params,
        "dtype": args.dtype,
        "seq_len": args.seq_len,
        "rows": ROWS,
        "ds_overrides": args.ds_overrides,
        "head_chunk_tokens": args.head_chunk,
        "malloc": f"glibc, MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}",
        "total_s": round(total_s, 1),
        "configs": rows,
    }
    record["ratios"] = report(record)
    suffix = ("-bf16" if args.dtype == "bf16" else "") + ("-ds" if args.ds_overrides else "")
    if args.seq_len != 1024:
        suffix += f"-seq{args.seq_len}"
    if args.head_chunk == 0:
        suffix += "-layers-only"
    path = args.json or RESULTS / f"memory-{time.strftime('%Y%m%d')}-{label}{suffix}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    print(f"raw results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
