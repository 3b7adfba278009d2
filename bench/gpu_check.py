"""The learner on a GPU, in one prepared run: does the update code that was only ever run on CPUs give the same
updates on CUDA, at ZeRO-3 with checkpointing, at 2 ranks, in bf16 and with LoRA?

Why: the update (``training/worker.py``) is developed and tested on CPU machines; its CUDA path (NCCL,
``engine.device``, bf16 on a GPU, ``torch.cuda`` memory) is not (docs/training.md, "Not verified"). GPU time is
scarce, so this script runs every check once, each stage in its own subprocess with its own timeout: a failing
stage records its error's key lines and the next one runs.
Everything uses the repo's own learner: ``UpdateWorker`` run in-process by this script's ``--run-job`` mode
(one process, or 2 ranks under ``torch.distributed.run``), the one-shot ``learner.run_update``, ``UpdateSpec``,
``bench.common.write_random_batch`` and ``bench.memory.key_line``. Models are random Llamas built locally
(``transformers.LlamaConfig``, nothing downloaded; a stand-in ``tokenizer_config.json`` + chat template as the
tests use, which the worker's save step copies).

Device command (repo root; the ignored folder ``.whl/`` must travel with the tree, e.g. ``carry: [".whl"]``)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && { python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/pf . || echo "pip install of pettingflow failed: gpu_check maps the source tree itself"; } && export PYTHONPATH=/tmp/pf:/tmp/site PYTHONUNBUFFERED=1 && python3 -m bench.gpu_check --device cuda --out "$OUT"

``.whl/`` (wheels of what the device lacks, for CPython 3.12 / manylinux x86-64; versions of requirements/cpu.lock):
deepspeed-0.19.8-py3-none-any (built from the sdist without ops: pure Python, no op is JIT-compiled by these
runs), pydantic-2.14.3, pydantic_core-2.50.4 (cp312 manylinux2014), annotated_types-0.8.0,
typing_inspection-0.4.5, typing_extensions-4.16.0 (pydantic needs >= 4.16), hjson-3.1.0, tenacity-9.2.1 (stage
``device_plan`` imports ``inference.server``); about 5 MiB. The import
closure of the update path is the device's packages (torch, transformers, peft, accelerate, pyarrow, fsspec,
numpy, pyyaml, psutil, safetensors, msgpack, einops, ninja, py-cpuinfo, tqdm, packaging) plus these: checked on
a bare Python 3.12 venv holding only those packages (torch 2.11.0, transformers 5.17.0) with this exact command,
in ``--device cpu`` mode. If pettingflow's own pip install fails on the device (an old setuptools), the script
builds the package layout of pyproject's ``[tool.setuptools.package-dir]`` from symlinks instead.

Stages (``--device cuda``; ``--budget-s`` 420 s caps the stages, so give the command 480 s):

1. ``env``: torch / CUDA / device name, capability and memory, NCCL version, TF32 settings, versions of
   deepspeed, transformers, peft, pydantic, and where each imported package came from (``/tmp/site``?).
2. ``cpu_vs_gpu_fp32``: one fp32 update (1 rank, ZeRO-0, 8 rows with random non-zero advantages, 2 epochs x 2
   windows = 4 optimizer steps, a 4-layer random Llama) on the CPU (``CUDA_VISIBLE_DEVICES=""``, 8 threads) and
   on the GPU (TF32 off: torch's default): ``rel = ||w_gpu - w_cpu|| / ||w_cpu - w_start||`` over all weights,
   max |diff| against the largest single weight update, loss and grad_norm of both. Pass: rel < 1e-3.
3. ``zero3_ckpt_vs_zero0``: GPU fp32, 1 rank, 2 successive updates in one resident worker (the second continues
   in memory, ``optimizer_state: resident``), ZeRO-3 + gradient checkpointing vs ZeRO-0: rel after each update
   (pass < 1e-3); the ZeRO-3 ``model/`` folder loads with ``AutoModelForCausalLM`` and every tensor equals its
   ``model.safetensors``; ``torch.cuda.max_memory_allocated`` per update (read in the worker process).
4. ``two_ranks_one_gpu``: 2 ranks (torchrun) on the one GPU. (a) ``PETTINGFLOW_DIST_BACKEND=gloo``: gloo on
   CUDA tensors, ZeRO-0 fp32, the stage-2 update: rel against stage 2's 1-rank GPU weights (pass < 1e-3);
   this mode sets ``LOCAL_RANK=0`` in both ranks (the job's ``same_gpu``), since DeepSpeed puts a rank on
   ``cuda:LOCAL_RANK``. (b) the default backend (NCCL) with both ranks on cuda:0: expected to fail with NCCL's
   duplicate-GPU error, 90 s timeout, recorded as is. (c) the repo's own one-shot path as a flow calls it
   (``learner.run_update``: Ray rank actors, default backend, so NCCL with ranks on cuda:0 and cuda:1 on a 1-GPU machine),
   90 s timeout, recorded as is (on the CPU: gloo, compared with the 1-rank run too). (a), (b), (c) run at once.
5. ``bf16_lora``: (a) a bf16 LoRA update (two agents, one adapter each, ZeRO-2) on the small model: it runs,
   both adapters are written and moved, the loss is finite. (b) a ~1.1B random Llama (hidden 2048, 16 layers,
   intermediate 8192, 32 heads / 8 KV heads, vocab 32000, tied embeddings), 8 rows x 1024 tokens, bf16,
   micro-batch 4: ZeRO-0 without checkpointing vs ZeRO-0 and ZeRO-3 with it (checkpointing = the decoder layers
   and the LM head in chunks of 512 tokens, ``head_chunk_tokens``), 2 updates each (the second resident, so the
   optimizer state exists before it), no weights saved: duration per update, max_memory_allocated, and the
   activation memory of the second update's training (peak during ``train()`` minus what was allocated before
   it; includes the transient gradients) with the checkpointing / no-checkpointing ratios (goal <= 0.5).

6. ``resident_learner``: the resident learner (``training.learner.Learner``) in a local Ray started by
   ``ray_cluster.init_ray``: the rank's placement bundle asks for the GPU, two fp32 ZeRO-3 + checkpointing updates
   (the second resident); the weights equal stage 3's in-process run. Needs ray, which is larger than what may
   travel: the ray-2.60.0 cp312 wheel repacked without ``ray/jars`` (Java) and source maps (45 MB), plus
   jsonschema, jsonschema-specifications, referencing, rpds-py; run it as
   ``--stages env zero3_ckpt_vs_zero0 resident_learner`` (stage 3 is its reference).

7. ``levers``: the update paths added after the first GPU run, 8 small fp32 runs at once on the GPU, each against
   the plain path (ZeRO-0, the model's own logits, ``head_at_loss_positions: false``): the LM head at the loss
   positions only (the default), chunked (``head_chunk_tokens: 16``), under ZeRO-2; zero-advantage rows skipped
   vs trained (4 of 8 rows at 0); pass rel < 1e-3. bf16 with fp32 master weights and ``master_weights: bf16``:
   the distance is reported, not judged (bf16 rounding).
8. ``device_plan``: the default config's ``between_updates: auto`` and device plan by the runtime's own path
   (``nvidia-smi -L`` as ``inference.server.gpu_ids`` reads it; one GPU: ``sleep``, one replica and one rank on
   it), the refusals for what one GPU cannot hold, and a child started with the replica's
   ``CUDA_VISIBLE_DEVICES`` sees that one GPU (``auto`` must not say ``keep`` on a GPU the learner shares, which
   the plan refuses).
9. ``zero3_head``: where ZeRO-3 + checkpointing spends the big bf16 model's update time with the LM head at the
   loss positions: the head in chunks of 512 and 4096 tokens, whole, and the model's own logits, beside ZeRO-0 +
   checkpointing.
10. ``mfu``: the learner's update MFU (goal >= 0.40) on a random Llama shaped like Qwen2.5-1.5B (hidden 1536, 28
    layers, intermediate 8960, 12 heads / 2 KV heads, vocab 151936, tied embeddings: 1.54B params, 1.31B in the
    decoder; built on the GPU in bf16, sdpa attention), bf16 with fp32 master weights, 1 rank, kl_coef 0, 1 epoch:
    64 rows x 2048 tokens (prompt 256, 1792 trained), mini-batch 32 (2 optimizer steps, so the second window's old
    log-probs take a forward of their own), micro-batch 8 (4 on a GPU under 120 GiB; halved again if the first
    case runs out of memory). Cases one after the other, each its own process, 2 updates (the second resident and
    timed), no weights saved: ZeRO-0 and ZeRO-2; if neither reaches the goal, levers: checkpointing with twice the
    micro-batch, and ``master_weights: bf16``. A case starts only if the stage's 240 s still hold it (else
    ``skipped_for_time``). FLOPs (``update_flops``), with ``N_dec = L (2 h^2 + 2 h kv + 3 h f)`` and ``N_head = V h``:
    one forward of a row = ``2 N_dec s + 2 N_head (s - p) + 2 L h s^2`` (the head at the loss positions only;
    causal attention: half of ``4 L h s^2``); model FLOPs = 3 forwards per row (6 N T) + 1 per row whose old
    log-probs are recomputed; checkpointing's recompute counts in HFU only; ``mfu_palm`` counts attention over the
    whole square (PaLM's ``6 N + 12 L h s`` per token). MFU = model FLOPs / (the warm update's wall time x peak),
    peaks: the datasheet's dense bf16 (989.5 TFLOP/s for an H100 / H200 SXM, by device name) and an 8192^3 bf16
    matmul measured in the stage. Per case also: old log-prob / train / other seconds, the training pass's
    forward / head+loss / backward / optimizer step (CUDA events around the engine's calls: ``PhaseClock``),
    tokens/s, peak memory, and ``checks`` that the worker did the work the count assumes. Pass: the best case's MFU
    against the datasheet >= 0.40. Expected to take 150-200 s on an H200 (not yet run there). Device command: the
    one above with ``--stages env mfu --budget-s 300`` (about 4 min in all; give it 420 s)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && { python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/pf . || echo "pip install of pettingflow failed: gpu_check maps the source tree itself"; } && export PYTHONPATH=/tmp/pf:/tmp/site PYTHONUNBUFFERED=1 && python3 -m bench.gpu_check --device cuda --stages env mfu --budget-s 300 --out "$OUT"

``--device cpu``: the same stages on tiny models where CUDA is not needed (this is how the script is tested on
the CPU machine): stage 2 compares 1 CPU thread with 2 threads (no GPU), stage 4 runs gloo and run_update on the CPU, stage
5 uses a tiny "big" model, stage 10 a tiny model (8 rows x 64 tokens) with ZeRO-0 and the checkpointing lever, its
peak the CPU's measured 256^3 bf16 matmul, the goal not judged; memory figures are the ranks' peak RSS instead of
CUDA allocations.

Output (``--out``, default ``$OUT``): ``gpu_check.json`` (every stage's status, figures, error key lines and log
tails), ``gpu_check.log`` (this console) and ``runs.log`` (the logs of every worker run, capped).
"""  # noqa: E501 (the device command is one line)

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import common, memory

MODULE = "bench.gpu_check"  # children run as `python -m bench.gpu_check`; child_env() makes the repo importable
STAGES = (
    "env",
    "cpu_vs_gpu_fp32",
    "zero3_ckpt_vs_zero0",
    "two_ranks_one_gpu",
    "bf16_lora",
    "resident_learner",
    "levers",
    "device_plan",
    "zero3_head",
    "mfu",
)
STAGE_TIMEOUT_S = {"env": 90, "cpu_vs_gpu_fp32": 180, "zero3_ckpt_vs_zero0": 180, "two_ranks_one_gpu": 200}
STAGE_TIMEOUT_S["bf16_lora"] = 300
STAGE_TIMEOUT_S["resident_learner"] = 240
STAGE_TIMEOUT_S["levers"] = 200
STAGE_TIMEOUT_S["device_plan"] = 90
STAGE_TIMEOUT_S["zero3_head"] = 300
STAGE_TIMEOUT_S["mfu"] = 240
PASS_REL = 1e-3
AGENTS = ["code_generator", "test_generator"]
# Llama shapes (tied embeddings like SmolLM2); seq = tokens per row, prompt = its prompt part
SHAPES: dict[str, dict[str, dict[str, int]]] = {
    "cuda": {
        "small": {"layers": 4, "hidden": 256, "intermediate": 688, "heads": 4, "kv_heads": 2, "vocab": 4096},
        "big": {"layers": 16, "hidden": 2048, "intermediate": 8192, "heads": 32, "kv_heads": 8, "vocab": 32000},
        # Qwen2.5-1.5B's shape as a Llama (no q/k/v biases): 1.54B params, 1.31B of them in the decoder
        "mfu": {"layers": 28, "hidden": 1536, "intermediate": 8960, "heads": 12, "kv_heads": 2, "vocab": 151936},
    },
    "cpu": {
        "small": {"layers": 2, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 512},
        "big": {"layers": 2, "hidden": 128, "intermediate": 256, "heads": 4, "kv_heads": 2, "vocab": 1024},
        "mfu": {"layers": 2, "hidden": 64, "intermediate": 160, "heads": 4, "kv_heads": 2, "vocab": 512},
    },
}
SEQ = {
    "cuda": {"small": (128, 32), "big": (1024, 64), "mfu": (2048, 256)},
    "cpu": {"small": (40, 12), "big": (96, 16), "mfu": (64, 16)},
}
ROWS = 8
STARTED = float(os.environ.get("GPU_CHECK_STARTED") or time.time())  # the whole run's start, in every child


def say(msg: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    print(f"[{stamp} +{time.time() - STARTED:6.1f}s] {msg}", flush=True)


def key_lines(text: str, n: int = 6) -> list[str]:
    """The failing rank's exception line (``bench.memory.key_line``) and the last few error-looking lines."""
    pat = re.compile(r"Error|Exception|error:|NCCL WARN|Duplicate GPU|invalid device|Traceback|Killed|timed out")
    found: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if line and pat.search(line) and line not in found:
            found.append(line[:400])
    return [memory.key_line(text), *found[-n:]]


# ------------------------------------------------------------------------------------------------ processes
class Proc:
    """A child process in its own session, its output in a log file, killed (whole group) at its deadline."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict[str, str], cwd: Path, timeout_s: float):
        self.name, self.log, self.timeout_s = name, log, timeout_s
        self.started = time.perf_counter()
        self.handle = open(log, "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            with_parent(cmd),
            stdout=self.handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )

    def wait(self) -> dict[str, Any]:
        left = max(1.0, self.timeout_s - (time.perf_counter() - self.started))
        timed_out = False
        try:
            rc = self.proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(self.proc)
            rc = self.proc.wait()
        finally:
            self.handle.close()
        text = self.log.read_text(errors="replace")
        out = {"rc": rc, "timed_out": timed_out, "wall_s": round(time.perf_counter() - self.started, 1)}
        if rc != 0 or timed_out:
            out["key_lines"] = key_lines(text) + ([f"timed out after {self.timeout_s:.0f} s"] if timed_out else [])
            out["log_tail"] = text[-3000:]
        return out


def with_parent(cmd: list[str]) -> list[str]:
    """``cmd`` in the repo's death-signal wrapper (group mode): if this process dies (a stage killed at its
    timeout), the child's whole process group (torchrun and its ranks) is killed too, not left on the GPU."""
    import signal

    try:
        from pettingflow import deathsig
    except ImportError:  # no pettingflow here: the child runs unwrapped (and fails on its own imports)
        return cmd
    return deathsig.wrap(cmd, signal.SIGKILL, group_grace_s=2.0)


def kill_group(proc: subprocess.Popen[Any]) -> None:
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the session this Popen started (torchrun and its ranks)


def child_env(threads: int, cuda_visible: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "LD_PRELOAD"):
        env.pop(key, None)
    env.update(
        OMP_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    env.update(extra or {})
    # The children run in the work folder, so `python -m bench.gpu_check` finds the bench package through
    # PYTHONPATH. The repo root goes last: a pettingflow installed into an earlier entry (the device's
    # /tmp/pf, or the symlink tree of pettingflow_path()) must win over the source folder pettingflow/, which
    # lacks the subpackages pyproject maps in from other folders (pettingflow.training is training/).
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(common.REPO)] if str(common.REPO) not in paths else paths)
    return env


# ------------------------------------------------------------------------------------------------ models, batches
def build_model(folder: Path, shape: dict[str, int], dtype: str, device: str) -> int:
    """A random Llama of ``shape`` saved in ``folder`` (weights in ``dtype``), stand-in tokenizer files beside it."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = common.random_llama_config(shape)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    (tmp / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    (tmp / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    params = sum(p.numel() for p in model.parameters())
    (tmp / "params.json").write_text(json.dumps({"params": params}))
    os.replace(tmp, folder)
    del model
    return params


def ensure_model(work: Path, mode: str, size: str, dtype: str = "fp32", device: str = "cpu") -> Path:
    folder = work / "models" / f"{size}-{dtype}"
    if not (folder / "config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        params = build_model(folder, SHAPES[mode][size], dtype, device)
        say(
            f"built random Llama {size} ({params / 1e6:.1f}M params, {dtype}, on {device}) in "
            f"{time.perf_counter() - t0:.1f} s"
        )
    return folder


def write_batch(
    path: Path,
    mode: str,
    size: str,
    seed: int,
    agents: list[str] | None = None,
    zero_rows: int = 0,
    rows: int = ROWS,
) -> Path:
    """``common.write_random_batch`` (``rows`` rows, every response token trained, sampler log-probs -log V), with
    its +-1 advantages replaced by random non-zero ones (the first ``zero_rows`` rows: 0) and, for LoRA, rows
    alternating between ``agents``."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    seq, prompt = SEQ[mode][size]
    vocab = SHAPES[mode][size]["vocab"]
    common.write_random_batch(path, rows, seq, prompt, vocab, seed=seed, sampler_logprob=-math.log(vocab))
    table = pq.read_table(path)
    rng = random.Random(seed)
    advantages = [rng.choice((-1.0, 1.0)) * rng.uniform(0.2, 1.5) for _ in range(rows)]
    columns = {"advantage": [0.0] * zero_rows + advantages[zero_rows:]}
    if agents:
        columns["agent_name"] = [agents[i % len(agents)] for i in range(rows)]
        columns["agent_idx"] = [i % len(agents) for i in range(rows)]
    for name, values in columns.items():
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))
    pq.write_table(table, path)
    return path


def spec_dict(batch: Path, out: Path, model: Path, seq: int, **kw: Any) -> dict[str, Any]:
    """An ``UpdateSpec`` (validated) as JSON: fp32 ZeRO-0, micro 2, mini 4, 2 epochs unless ``kw`` says otherwise."""
    from pettingflow.training.launch import UpdateSpec

    training = {
        "num_processes": 1,
        "zero_stage": 0,
        "dtype": "fp32",
        "micro_batch_size": 2,
        "mini_batch_size": 4,
        "epochs": 2,
        "lr": 1e-4,
        "max_seq_len": seq,
        "malloc": "system",
    }
    training.update(kw.pop("training", {}))
    spec = {
        "batch_uri": str(batch),
        "policy": "shared",
        "out_dir": str(out),
        "init_model_dir": str(model),
        "training": training,
        "algorithm": {"kl_coef": 0.0},
        "save_resume_state": False,
        "seed": 0,
        "start_version": "base",
        "version": "u1",
        **kw,
    }
    return UpdateSpec.model_validate(spec).model_dump(mode="json")


# ------------------------------------------------------------------------------------------------ worker runs
class PhaseClock:
    """Where the training pass's time goes, without adding a synchronisation: the engine's ``forward``,
    ``backward`` and ``step`` of each micro-batch are bracketed by CUDA events on the current stream (on the CPU:
    ``perf_counter``), read once after the pass. ``head_loss`` is the rest of each micro-batch (from its forward's
    start to its step's end): the LM head at the loss positions, the log-softmax and the loss. ``optimizer_step``:
    the ``step`` calls at an accumulation boundary (the AdamW step, clipping), ``step_other`` the others."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.spans: list[tuple[str, Any, Any]] = []  # (phase, start, end) in call order

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wrap(self, engine: Any) -> None:
        """Brackets ``engine.forward`` / ``backward`` / ``step`` (instance attributes: ``engine(...)`` runs
        ``self.forward``, the worker calls the other two by name)."""
        if getattr(engine, "_gpu_check_clock", None) is self:
            return
        forward, backward, step = engine.forward, engine.backward, engine.step

        def timed(name: str | None, fn: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                label = name or ("optimizer_step" if engine.is_gradient_accumulation_boundary() else "step_other")
                start = self.mark()
                out = fn(*args, **kwargs)
                self.spans.append((label, start, self.mark()))
                return out

            return call

        engine.forward = timed("forward", forward)
        engine.backward = timed("backward", backward)
        engine.step = timed(None, step)
        engine._gpu_check_clock = self

    def read(self) -> dict[str, Any]:
        """Seconds per phase since the last read, ``micro_batches``, and ``head_loss`` (see the class), then
        forgets them."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        spans, self.spans = self.spans, []

        def seconds(start: Any, end: Any) -> float:
            return start.elapsed_time(end) / 1000 if self.cuda else end - start

        out: dict[str, Any] = {}
        for label, a, b in spans:
            out[label] = out.get(label, 0.0) + seconds(a, b)
        forwards = [a for label, a, _ in spans if label == "forward"]
        step_ends = [b for label, _, b in spans if label in ("optimizer_step", "step_other")]
        out["micro_batches"] = len(forwards)
        if forwards and len(step_ends) == len(forwards):
            total = sum(seconds(a, b) for a, b in zip(forwards, step_ends, strict=True))
            known = sum(out.get(k, 0.0) for k in ("forward", "backward", "optimizer_step", "step_other"))
            out["micro_batch_total"] = total
            out["head_loss"] = max(0.0, total - known)
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def run_job(job_path: str) -> int:
    """``--run-job JOB``: one rank. Runs the job's specs one after another in one resident ``UpdateWorker``
    (so a second spec whose ``start_version`` is the first's ``version`` continues in memory) and writes
    ``result-rank<r>.json`` beside the job: metrics, device, CUDA memory (peak per update, before and during
    ``train()``) and peak RSS; with ``phases`` in the job, the training pass's time per phase (``PhaseClock``)
    and the attention implementation the model runs."""
    import logging
    import resource

    job = json.loads(Path(job_path).read_text())
    if job.get("same_gpu"):
        os.environ["LOCAL_RANK"] = "0"  # DeepSpeed binds a rank to cuda:LOCAL_RANK; one GPU: all on cuda:0
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    import torch
    import torch.distributed as dist

    from pettingflow.training.launch import UpdateSpec
    from pettingflow.training.worker import UpdateWorker, ensure_dist_env

    ensure_dist_env()
    cuda = torch.cuda.is_available()
    skip_save = bool(job.get("skip_save"))
    clock = PhaseClock(cuda) if job.get("phases") else None

    class CheckWorker(UpdateWorker):
        def train(self) -> None:
            if cuda:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            if clock is not None:
                clock.wrap(self.engine)
            super().train()
            if clock is not None:
                self.phases = clock.read()
            if cuda:
                torch.cuda.synchronize()
                self.train_memory = {"before_train": before, "train_peak": torch.cuda.max_memory_allocated()}

        def save_checkpoint(self) -> None:
            if not skip_save:
                return super().save_checkpoint()
            self.metrics["outputs"] = None
            self.metrics["optimizer_saved"] = False
            return None

    worker = CheckWorker()
    results: list[dict[str, Any]] = []
    keys = (
        "loss",
        "pg_loss",
        "grad_norm",
        "grad_norm_max",
        "optimizer_steps",
        "global_step",
        "micro_batches",
        "optimizer_state",
        "num_processes",
        "zero_stage",
        "dtype",
        "duration_s",
        "timings",
        "tokens_per_s",
        "outputs",
        "agents",
        "max_rss_mb_per_rank",
        "tokens",
        "model_tokens",
        "old_logprob_forwards_skipped",
        "step_s",
    )
    try:
        for i, raw in enumerate(job["specs"]):
            spec = UpdateSpec.model_validate(raw)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            metrics = worker.update(spec)
            entry: dict[str, Any] = {"metrics": {k: metrics.get(k) for k in keys}}
            entry["wall_s"] = round(time.perf_counter() - t0, 2)
            entry["engine_device"] = str(worker.engine.device)
            entry["param_device"] = str(next(worker.engine.module.parameters()).device)
            entry["backend"] = dist.get_backend()
            if clock is not None:
                entry["phases"] = getattr(worker, "phases", None)
                entry["attn_implementation"] = getattr(worker.engine.module.config, "_attn_implementation", None)
            if cuda:
                torch.cuda.synchronize()
                entry["max_memory_allocated"] = torch.cuda.max_memory_allocated()
                entry["max_memory_reserved"] = torch.cuda.max_memory_reserved()
                entry.update(getattr(worker, "train_memory", {}))
            entry["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            results.append(entry)
            mem = f", max_memory_allocated {entry['max_memory_allocated'] / 2**30:.2f} GiB" if cuda else ""
            print(
                f"rank{rank} update {i + 1}/{len(job['specs'])}: loss {metrics.get('loss')}, grad_norm "
                f"{metrics.get('grad_norm')}, {entry['wall_s']} s on {entry['engine_device']}{mem}",
                flush=True,
            )
    finally:
        worker.cleanup()
        if dist.is_initialized():
            dist.destroy_process_group()
    out = Path(job_path).with_name(f"result-rank{rank}.json")
    out.write_text(json.dumps({"rank": rank, "updates": results}, indent=1, default=str))
    return 0


def start_job(
    work: Path,
    name: str,
    specs: list[dict[str, Any]],
    *,
    ranks: int = 1,
    threads: int = 4,
    cuda_visible: str | None = None,
    env: dict[str, str] | None = None,
    same_gpu: bool = False,
    skip_save: bool = False,
    phases: bool = False,
    timeout_s: float = 120,
) -> Proc:
    from pettingflow.processes import free_port

    timeout_s *= float(os.environ.get("GPU_CHECK_TIMEOUT_SCALE", "1"))  # --device cpu: slower runs
    folder = work / "jobs" / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    job = folder / "job.json"
    job.write_text(
        json.dumps({"specs": specs, "same_gpu": same_gpu, "skip_save": skip_save, "phases": phases}, indent=1)
    )
    if ranks == 1:
        cmd = [sys.executable, "-m", MODULE, "--run-job", str(job)]
        extra = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        extra["MASTER_PORT"] = str(free_port())
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={ranks}",
            "--nnodes=1",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            "--module",
            MODULE,
            "--run-job",
            str(job),
        ]
        extra = {}
    say(f"  run {name}: {ranks} rank(s), {len(specs)} update(s), timeout {timeout_s:.0f} s")
    return Proc(
        name, cmd, folder / "run.log", child_env(threads, cuda_visible, {**extra, **(env or {})}), work, timeout_s
    )


def finish_job(proc: Proc) -> dict[str, Any]:
    out = proc.wait()
    folder = proc.log.parent
    ranks = sorted(folder.glob("result-rank*.json"))
    out["ranks"] = [json.loads(p.read_text()) for p in ranks]
    out["ok"] = out["rc"] == 0 and not out["timed_out"] and bool(ranks)
    if out["ok"]:
        out["updates"] = out["ranks"][0]["updates"]
    say(
        f"  run {proc.name}: {'ok' if out['ok'] else 'FAILED'} in {out['wall_s']} s"
        + ("" if out["ok"] else f": {out.get('key_lines', ['?'])[0]}")
    )
    with open(proc.log.parent.parent.parent / "runs.log", "a") as f:
        f.write(f"\n===== run {proc.name} (rc {out['rc']}, {out['wall_s']} s) =====\n")
        f.write(proc.log.read_text(errors="replace")[-200_000:])
    return out


def run_jobs(procs: list[Proc]) -> list[dict[str, Any]]:
    return [finish_job(p) for p in procs]


# ------------------------------------------------------------------------------------------------ comparisons
def load_weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    if not out:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return out


def distance(candidate: Path, reference: Path, start: Path) -> dict[str, Any]:
    """How far ``candidate``'s weights are from ``reference``'s, relative to the update ``reference`` made from
    ``start``: rel = ||cand - ref|| / ||ref - start|| (all tensors together), and max |cand - ref| against the
    largest single-weight update."""
    a, b, s = load_weights(candidate), load_weights(reference), load_weights(start)
    keys = sorted(set(a) & set(b) & set(s))
    diff2 = upd2 = 0.0
    max_diff = max_upd = 0.0
    for k in keys:
        x, y, z = a[k].double(), b[k].double(), s[k].double()
        d, u = x - y, y - z
        diff2 += float((d * d).sum())
        upd2 += float((u * u).sum())
        max_diff = max(max_diff, float(d.abs().max()))
        max_upd = max(max_upd, float(u.abs().max()))
    rel = math.sqrt(diff2) / math.sqrt(upd2) if upd2 > 0 else float("nan")
    return {
        "rel": rel,
        "diff_l2": math.sqrt(diff2),
        "update_l2": math.sqrt(upd2),
        "max_abs_diff": max_diff,
        "max_abs_update": max_upd,
        "max_diff_over_max_update": max_diff / max_upd if max_upd else float("nan"),
        "tensors": len(keys),
        "keys_only_in_one": sorted(set(a) ^ set(b)),
    }


def verdict(rel: float) -> str:
    return "pass" if rel == rel and rel < PASS_REL else "fail"


def gib(value: Any) -> Any:
    return round(value / 2**30, 3) if isinstance(value, int | float) else None


def memory_of(update: dict[str, Any]) -> dict[str, Any]:
    keys = ("max_memory_allocated", "max_memory_reserved", "before_train", "train_peak", "max_rss_bytes")
    out = {f"{k}_gib": gib(update.get(k)) for k in keys if update.get(k) is not None}
    if "train_peak" in update:
        out["train_activation_gib"] = gib(update["train_peak"] - update["before_train"])
    return out


# ------------------------------------------------------------------------------------------------ stages
def stage_env(work: Path, mode: str, args: Any) -> dict[str, Any]:
    import importlib
    import importlib.metadata as md

    out: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}
    out["pythonpath"] = os.environ.get("PYTHONPATH", "")
    mods = [
        "torch",
        "deepspeed",
        "transformers",
        "peft",
        "accelerate",
        "pydantic",
        "pydantic_core",
        "typing_extensions",
        "hjson",
        "pyarrow",
        "fsspec",
        "safetensors",
        "numpy",
        "yaml",
        "pettingflow",
    ]
    out["modules"] = {}
    for name in mods:
        try:
            m = importlib.import_module(name)
            out["modules"][name] = {"file": getattr(m, "__file__", None), "version": getattr(m, "__version__", None)}
        except Exception as exc:
            out["modules"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    for dist_name in ("deepspeed", "transformers", "peft", "torch", "pydantic", "accelerate"):
        try:
            out.setdefault("versions", {})[dist_name] = md.version(dist_name)
        except md.PackageNotFoundError:
            out.setdefault("versions", {})[dist_name] = None
    closure = [
        "pettingflow.training.worker",
        "pettingflow.training.model",
        "pettingflow.training.logprobs",
        "pettingflow.training.optim",
        "pettingflow.training.launch",
        "pettingflow.training.data",
        "pettingflow.storage.schema",
        "peft",
        "transformers.models.llama.modeling_llama",
        "deepspeed.comm.torch",
    ]
    out["import_errors"] = {}
    for name in closure:
        try:
            importlib.import_module(name)
        except Exception as exc:
            out["import_errors"][name] = f"{type(exc).__name__}: {exc}"
    third = sorted({n.split(".")[0] for n in sys.modules if not n.startswith("_")} - set(sys.stdlib_module_names))
    out["from_site"] = sorted(
        n for n in third if str(getattr(sys.modules.get(n), "__file__", "") or "").startswith("/tmp/site")
    )
    import torch

    out["torch"] = torch.__version__
    out["cuda_available"] = torch.cuda.is_available()
    out["torch_cuda"] = torch.version.cuda
    matmul = torch.backends.cuda.matmul
    out["matmul_allow_tf32"] = matmul.allow_tf32
    out["matmul_fp32_precision"] = getattr(matmul, "fp32_precision", None)
    out["cudnn_allow_tf32"] = torch.backends.cudnn.allow_tf32
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out["device_count"] = torch.cuda.device_count()
        out["device_name"] = torch.cuda.get_device_name(0)
        out["capability"] = list(torch.cuda.get_device_capability(0))
        out["total_memory_gib"] = gib(props.total_memory)
        out["bf16_supported"] = torch.cuda.is_bf16_supported()
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:
            out["nccl"] = f"error: {exc}"
        x = torch.randn(512, 512, device="cuda", dtype=torch.float64)
        y = torch.randn(512, 512, device="cuda", dtype=torch.float64)
        ref = (x @ y).cpu()
        out["fp32_matmul_rel_err"] = float(
            ((x.float() @ y.float()).double().cpu() - ref).norm() / ref.norm()
        )  # ~1e-6 with TF32 off, ~1e-3 with it on
        from deepspeed.accelerator import get_accelerator

        out["deepspeed_accelerator"] = get_accelerator()._name
    smi = shutil.which("nvidia-smi")
    if smi:
        q = "--query-gpu=name,memory.total,driver_version"
        res = subprocess.run([smi, q, "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        out["nvidia_smi"] = res.stdout.strip()
    bad = out["import_errors"] or (mode == "cuda" and not out["cuda_available"])
    out["status"] = "fail" if bad else "pass"
    return out


def fp32_specs(
    work: Path, mode: str, name: str, batch: Path, model: Path, threads: int | None = None, **training: Any
) -> list[dict[str, Any]]:
    """The one fp32 update of stages 2 and 4 (ZeRO-0, 8 rows, 2 windows x 2 epochs), into ``out/<name>``."""
    seq = SEQ[mode]["small"][0]
    return [spec_dict(batch, work / "out" / name, model, seq, training=training, num_threads=threads)]


def stage_cpu_vs_gpu(work: Path, mode: str, args: Any) -> dict[str, Any]:
    model = ensure_model(work, mode, "small")
    batch = write_batch(work / "batch-a.parquet", mode, "small", seed=1)
    if mode == "cuda":  # both at once: the CPU run uses 8 of the 16 cores, the GPU run the GPU
        ref = start_job(
            work,
            "s2-ref",
            fp32_specs(work, mode, "s2-ref", batch, model, threads=8),
            threads=8,
            cuda_visible="",
            timeout_s=150,
        )
        dev = start_job(work, "s2-dev", fp32_specs(work, mode, "s2-dev", batch, model), threads=4, timeout_s=150)
        r_ref, r_dev = finish_job(ref), finish_job(dev)
        what = "GPU vs CPU (8 threads)"
    else:  # no GPU: 2 threads vs 1 thread, one after the other (tests the pipeline, not the hardware)
        ref = start_job(
            work, "s2-ref", fp32_specs(work, mode, "s2-ref", batch, model, threads=1), threads=1, timeout_s=150
        )
        r_ref = finish_job(ref)
        dev = start_job(
            work, "s2-dev", fp32_specs(work, mode, "s2-dev", batch, model, threads=2), threads=2, timeout_s=150
        )
        r_dev = finish_job(dev)
        what = "CPU 2 threads vs CPU 1 thread (no GPU in --device cpu)"
    out: dict[str, Any] = {"what": what, "reference_run": r_ref, "device_run": r_dev}
    if not (r_ref["ok"] and r_dev["ok"]):
        out["status"] = "fail"
        return out
    out["distance"] = distance(work / "out" / "s2-dev" / "model", work / "out" / "s2-ref" / "model", model)
    m_ref, m_cand = r_ref["updates"][0]["metrics"], r_dev["updates"][0]["metrics"]
    out["loss"] = {"reference": m_ref["loss"], "candidate": m_cand["loss"]}
    out["grad_norm"] = {"reference": m_ref["grad_norm"], "candidate": m_cand["grad_norm"]}
    out["devices"] = {
        "reference": r_ref["updates"][0]["engine_device"],
        "candidate": r_dev["updates"][0]["engine_device"],
    }
    out["status"] = verdict(out["distance"]["rel"])
    out["headline"] = (
        f"{what}: rel {out['distance']['rel']:.2e} (pass < {PASS_REL:g}), max|diff|/max|update| "
        f"{out['distance']['max_diff_over_max_update']:.2e}, loss {m_cand['loss']:.6f} vs {m_ref['loss']:.6f}, "
        f"grad_norm {m_cand['grad_norm']:.6f} vs {m_ref['grad_norm']:.6f}"
    )
    return out


def stage_zero3(work: Path, mode: str, args: Any) -> dict[str, Any]:
    model = ensure_model(work, mode, "small")
    seq = SEQ[mode]["small"][0]
    batches = [
        write_batch(work / "batch-a.parquet", mode, "small", seed=1),
        write_batch(work / "batch-b.parquet", mode, "small", seed=2),
    ]
    runs = {"z3ckpt": {"zero_stage": 3, "gradient_checkpointing": True}, "z0": {"zero_stage": 0}}

    def specs(name: str) -> list[dict[str, Any]]:
        return [
            spec_dict(batches[0], work / "out" / f"s3-{name}-u1", model, seq, training=runs[name]),
            spec_dict(
                batches[1],
                work / "out" / f"s3-{name}-u2",
                model,
                seq,
                training=runs[name],
                start_version="u1",
                version="u2",
            ),
        ]

    if mode == "cuda":  # independent processes: each one's memory peak is its own
        results = dict(
            zip(runs, run_jobs([start_job(work, f"s3-{n}", specs(n), timeout_s=150) for n in runs]), strict=True)
        )
    else:
        results = {n: finish_job(start_job(work, f"s3-{n}", specs(n), threads=2, timeout_s=150)) for n in runs}
    out: dict[str, Any] = {"runs": results}
    if not all(r["ok"] for r in results.values()):
        out["status"] = "fail"
        return out
    out["distance"] = {
        f"u{u}": distance(work / "out" / f"s3-z3ckpt-u{u}" / "model", work / "out" / f"s3-z0-u{u}" / "model", model)
        for u in (1, 2)
    }
    out["optimizer_state_update2"] = {n: r["updates"][1]["metrics"]["optimizer_state"] for n, r in results.items()}
    out["memory"] = {n: [memory_of(u) for u in r["updates"]] for n, r in results.items()}
    # the ZeRO-3 HF folder: loads with transformers and holds exactly its safetensors' tensors
    import torch
    from transformers import AutoModelForCausalLM

    folder = work / "out" / "s3-z3ckpt-u2" / "model"
    loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True)
    state = loaded.state_dict()
    stored = load_weights(folder)
    unequal = [k for k, v in stored.items() if k not in state or not torch.equal(state[k], v)]
    out["hf_load"] = {
        "tensors": len(stored),
        "unequal": unequal[:10],
        "n_unequal": len(unequal),
        "tied": loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr(),
    }
    rels = [out["distance"][u]["rel"] for u in ("u1", "u2")]
    ok = all(verdict(r) == "pass" for r in rels) and not unequal
    ok = ok and out["optimizer_state_update2"]["z3ckpt"] == "resident"
    out["status"] = "pass" if ok else "fail"
    mem_key, mem_name = (
        ("max_memory_allocated_gib", "max_memory_allocated") if mode == "cuda" else ("max_rss_bytes_gib", "peak RSS")
    )
    peaks = {n: [m.get(mem_key) for m in v] for n, v in out["memory"].items()}
    out["headline"] = (
        f"ZeRO-3+ckpt vs ZeRO-0: rel {rels[0]:.2e} after update 1, {rels[1]:.2e} after update 2 (resident); "
        f"HF folder loads, {len(stored) - len(unequal)}/{len(stored)} tensors equal; {mem_name} GiB per update {peaks}"
    )
    return out


def stage_two_ranks(work: Path, mode: str, args: Any) -> dict[str, Any]:
    model = ensure_model(work, mode, "small")
    batch = work / "batch-a.parquet"
    if not batch.is_file():
        write_batch(batch, mode, "small", seed=1)
    one_rank = work / "out" / "s2-dev" / "model"  # stage 2's device run: the 1-rank run on this device
    out: dict[str, Any] = {}
    procs = [
        start_job(
            work,
            "s4-gloo",
            fp32_specs(work, mode, "s4-gloo", batch, model, num_processes=2),
            ranks=2,
            threads=2,
            env={"PETTINGFLOW_DIST_BACKEND": "gloo"},
            same_gpu=True,
            timeout_s=120,
        )
    ]
    if mode == "cuda":
        procs.append(
            start_job(
                work,
                "s4-nccl-same-gpu",
                fp32_specs(work, mode, "s4-nccl", batch, model, num_processes=2),
                ranks=2,
                threads=2,
                same_gpu=True,
                timeout_s=90,
            )
        )
    repo: dict[str, Any] = {}
    repo_timeout = 90 * float(os.environ.get("GPU_CHECK_TIMEOUT_SCALE", "1"))

    def repo_path() -> None:  # the repo's one-shot launcher as a flow calls it: torchrun, default backend
        from pettingflow.training import UpdateError, UpdateSpec, run_update

        spec = UpdateSpec.model_validate(fp32_specs(work, mode, "s4-repo", batch, model, num_processes=2)[0])
        t0 = time.perf_counter()
        try:
            metrics = run_update(spec, timeout_s=repo_timeout)
            repo.update(ok=True, loss=metrics.get("loss"), num_processes=metrics.get("num_processes"))
        except UpdateError as exc:
            repo.update(ok=False, key_lines=key_lines(str(exc)), log_tail=str(exc)[-3000:])
        except Exception as exc:  # anything else: recorded, the stage goes on
            repo.update(ok=False, key_lines=[f"{type(exc).__name__}: {exc}"])
        repo["wall_s"] = round(time.perf_counter() - t0, 1)

    say(f"  run s4-repo: learner.run_update, 2 ranks, default backend, timeout {repo_timeout:.0f} s")
    thread = threading.Thread(target=repo_path, daemon=True)
    thread.start()
    results = run_jobs(procs)
    gloo = results[0]
    out["gloo_same_gpu"] = gloo
    thread.join(timeout=repo_timeout + 30)
    out["repo_run_update_default_backend"] = repo or {"ok": False, "key_lines": ["did not finish in time"]}
    say(f"  run s4-repo: {'ok' if repo.get('ok') else 'FAILED: ' + (repo.get('key_lines') or ['?'])[0]}")
    if mode == "cuda":
        out["nccl_same_gpu"] = results[1]
    if not gloo["ok"]:
        out["status"] = "fail"
        return out
    if not list(one_rank.glob("*.safetensors")):  # stage 2 did not run or failed: the 1-rank run here
        r1 = finish_job(start_job(work, "s2-dev", fp32_specs(work, mode, "s2-dev", batch, model), timeout_s=120))
        out["one_rank_run"] = r1
    out["distance"] = distance(work / "out" / "s4-gloo" / "model", one_rank, model)
    out["devices"] = [r["updates"][0]["engine_device"] for r in gloo["ranks"]]
    out["backend"] = gloo["updates"][0]["backend"]
    if repo.get("ok"):
        out["repo_run_update_default_backend"]["distance"] = distance(
            work / "out" / "s4-repo" / "model", one_rank, model
        )
    out["status"] = verdict(out["distance"]["rel"])
    nccl = "; repo run_update (default backend): " + (
        f"ran, rel {repo['distance']['rel']:.2e}" if repo.get("ok") else (repo.get("key_lines") or ["failed"])[0][:160]
    )
    if mode == "cuda":
        n = results[1]
        nccl += "; nccl, both ranks on cuda:0: " + ("ran" if n["ok"] else (n.get("key_lines") or ["failed"])[0][:160])
    out["headline"] = (
        f"2 ranks gloo ({', '.join(out['devices'])}) vs 1 rank: rel {out['distance']['rel']:.2e} "
        f"(pass < {PASS_REL:g}){nccl}"
    )
    return out


def stage_bf16_lora(work: Path, mode: str, args: Any) -> dict[str, Any]:
    import torch

    small = ensure_model(work, mode, "small")
    seq_small = SEQ[mode]["small"][0]
    lora_batch = write_batch(work / "batch-lora.parquet", mode, "small", seed=3, agents=AGENTS)
    lora_spec = spec_dict(
        lora_batch,
        work / "out" / "s5-lora",
        small,
        seq_small,
        specialization="lora",
        agents=AGENTS,
        lora={"rank": 8, "alpha": 16},
        training={"dtype": "bf16", "zero_stage": 2, "lr": 1e-3, "epochs": 1},
    )
    lora = start_job(work, "s5-lora", [lora_spec], threads=2, timeout_s=120)
    big: Path | None = None
    out: dict[str, Any] = {}
    try:
        if mode == "cuda":  # build the big model on the GPU while the LoRA run goes
            big = ensure_model(work, mode, "big", dtype="bf16", device="cuda")
            torch.cuda.empty_cache()
    except Exception as exc:  # recorded; the LoRA run is still collected
        out["big_error"] = key_lines(f"{type(exc).__name__}: {exc}")
        say(f"  building the big model failed: {type(exc).__name__}: {exc}")
    r_lora = finish_job(lora)
    if mode != "cuda":
        big = ensure_model(work, mode, "big", dtype="bf16")
    out["lora_run"] = r_lora
    lora_ok = False
    if r_lora["ok"]:
        from safetensors.torch import load_file

        m = r_lora["updates"][0]["metrics"]
        adapters = (m.get("outputs") or {}).get("adapters") or {}
        moved = {}
        for agent in AGENTS:
            f = Path(adapters.get(agent, "/nonexistent")) / "adapter_model.safetensors"
            if f.is_file():
                t = load_file(str(f))
                moved[agent] = max(float(v.float().abs().max()) for k, v in t.items() if "lora_B" in k)
        out["lora"] = {"loss": m["loss"], "adapters": adapters, "max_abs_lora_B": moved, "agents": m.get("agents")}
        lora_ok = math.isfinite(m["loss"] or float("nan")) and len(moved) == 2 and all(v > 0 for v in moved.values())
    if big is None:
        out["status"] = "fail"
        out["headline"] = f"LoRA bf16: {'ok' if lora_ok else 'FAILED'}; big model: {out['big_error'][0]}"
        return out
    big_batch = write_batch(work / "batch-big.parquet", mode, "big", seed=4)
    # checkpointing = decoder layers checkpointed + the LM head in chunks of 512 tokens (head_chunk_tokens)
    ckpt = {"gradient_checkpointing": True, "head_chunk_tokens": 512}
    cases = {"z3ckpt": {"zero_stage": 3, **ckpt}, "z0": {"zero_stage": 0}, "z0ckpt": {"zero_stage": 0, **ckpt}}
    big_runs, summary = run_big_cases(work, mode, big, big_batch, cases, "s5-big")
    out["big_runs"] = big_runs
    params = json.loads((big / "params.json").read_text())["params"]
    out["big_params"] = params
    out["big"] = summary
    ratio = ratio_z0 = None
    if len(summary) == len(cases) and mode == "cuda":
        act = {n: s["memory"][1].get("train_activation_gib") for n, s in summary.items()}
        if act["z0"]:
            ratio, ratio_z0 = act["z3ckpt"] / act["z0"], act["z0ckpt"] / act["z0"]
        out["activation_ratio_ckpt_over_none"] = ratio
        out["activation_ratio_z0_ckpt_over_none"] = ratio_z0
    big_ok = len(summary) == len(cases) and all(
        math.isfinite(x) for s in summary.values() for x in s["loss"] if x is not None
    )
    out["status"] = "pass" if lora_ok and big_ok else "fail"
    parts = [
        f"LoRA bf16: {'ok' if lora_ok else 'FAILED'}" + (f" (loss {out['lora']['loss']:.4f})" if "lora" in out else "")
    ]
    for name, s in summary.items():
        mem = s["memory"][-1]
        parts.append(
            f"{params / 1e6:.1f}M params {name}: {s['duration_s']} s per update, max_memory_allocated "
            f"{mem.get('max_memory_allocated_gib')} GiB, activations {mem.get('train_activation_gib')} GiB"
        )
    if ratio is not None and ratio_z0 is not None:
        parts.append(f"activation ratio ckpt/none: ZeRO-3 {ratio:.3f}, ZeRO-0 {ratio_z0:.3f} (goal <= 0.5)")
    out["headline"] = "; ".join(parts)
    return out


def run_big_cases(
    work: Path, mode: str, big: Path, batch: Path, cases: dict[str, dict[str, Any]], prefix: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two bf16 updates of the big model per case (the second resident, so the optimizer state exists before it),
    one case after the other since their durations are compared; no weights saved. Returns the runs and, per
    case that ran, durations, train/setup times, losses and memory per update."""
    seq_big = SEQ[mode]["big"][0]
    runs = {}
    for name, training in cases.items():
        t = {"dtype": "bf16", "micro_batch_size": 4, "mini_batch_size": 8, "epochs": 1, "lr": 1e-5, **training}
        out_dir = work / "out" / f"{prefix}-{name}"
        specs = [
            spec_dict(batch, out_dir, big, seq_big, training=t),
            spec_dict(batch, out_dir, big, seq_big, training=t, start_version="u1", version="u2"),
        ]
        timeout_s = 150 if mode == "cuda" else 300
        runs[name] = finish_job(
            start_job(work, f"{prefix}-{name}", specs, threads=4, skip_save=True, timeout_s=timeout_s)
        )
    summary = {}
    for name, r in runs.items():
        if r["ok"]:
            summary[name] = {
                "duration_s": [u["metrics"]["duration_s"] for u in r["updates"]],
                "train_s": [(u["metrics"]["timings"] or {}).get("train_s") for u in r["updates"]],
                "setup_s": (r["updates"][0]["metrics"]["timings"] or {}).get("setup_s"),
                "loss": [u["metrics"]["loss"] for u in r["updates"]],
                "memory": [memory_of(u) for u in r["updates"]],
            }
    return runs, summary


def stage_zero3_head(work: Path, mode: str, args: Any) -> dict[str, Any]:
    """What the LM head costs the big model's ZeRO-3 + checkpointing update when it runs at the loss positions
    in chunks: the same update with the head in chunks of 512 and 4096 tokens, whole (one head call per
    micro-batch) and as the model's own logits, beside ZeRO-0 + checkpointing as the card's baseline. Under ZeRO-3
    each head call gathers the (tied) embedding matrix."""
    big = ensure_model(work, mode, "big", dtype="bf16", device="cuda" if mode == "cuda" else "cpu")
    batch = write_batch(work / "batch-big.parquet", mode, "big", seed=4)
    ckpt = {"gradient_checkpointing": True}
    cases = {
        "z0_chunk512": {"zero_stage": 0, **ckpt, "head_chunk_tokens": 512},
        "z3_chunk512": {"zero_stage": 3, **ckpt, "head_chunk_tokens": 512},
        "z3_chunk4096": {"zero_stage": 3, **ckpt, "head_chunk_tokens": 4096},
        "z3_whole": {"zero_stage": 3, **ckpt, "head_chunk_tokens": 0},
        "z3_own_logits": {"zero_stage": 3, **ckpt, "head_chunk_tokens": 0, "head_at_loss_positions": False},
    }
    runs, summary = run_big_cases(work, mode, big, batch, cases, "s9")
    out: dict[str, Any] = {"runs": runs, "big": summary, "cases": cases}
    out["status"] = "pass" if len(summary) == len(cases) else "fail"
    out["headline"] = "; ".join(
        f"{n}: {s['duration_s']} s, train {s['train_s']} s, peak {s['memory'][-1].get('max_memory_allocated_gib')} GiB"
        for n, s in summary.items()
    ) + (f"; FAILED: {sorted(set(cases) - set(summary))}" if len(summary) < len(cases) else "")
    return out


def stage_resident_learner(work: Path, mode: str, args: Any) -> dict[str, Any]:
    """The resident learner as a run uses it (``training.learner.Learner``): a local Ray started by
    ``ray_cluster.init_ray`` (token auth) that sees the machine's GPU, one rank actor whose placement bundle asks
    for it (``rank_bundle``: one GPU per rank when the cluster has one for each), two updates (the second
    continues in memory), fp32 ZeRO-3 + checkpointing: the weights equal stage 3's in-process worker run
    (``s3-z3ckpt``) on the same batches. Needs ray (a wheel without its Java jars travels in ``.whl``)."""
    import ray

    from pettingflow.ray_cluster import init_ray
    from pettingflow.training.launch import UpdateSpec
    from pettingflow.training.learner import Learner, rank_bundle

    model = ensure_model(work, mode, "small")
    seq = SEQ[mode]["small"][0]
    batches = [work / "batch-a.parquet", work / "batch-b.parquet"]
    for i, b in enumerate(batches):
        if not b.is_file():
            write_batch(b, mode, "small", seed=i + 1)
    training = {"zero_stage": 3, "gradient_checkpointing": True}
    specs = [
        spec_dict(batches[0], work / "out" / "s6-u1", model, seq, training=training),
        spec_dict(batches[1], work / "out" / "s6-u2", model, seq, training=training, start_version="u1", version="u2"),
    ]
    os.environ.setdefault("PETTINGFLOW_HOME", str(work / "pf-home"))
    init_ray(num_cpus=4, include_dashboard=False, log_to_driver=False)
    out: dict[str, Any] = {"cluster": {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")}}
    out["bundle"] = rank_bundle(ray.cluster_resources(), 1, 1.0)
    learner = Learner("shared", 1, work / "learner-logs", master_host="127.0.0.1", malloc="system")
    try:
        learner.start()
        metrics = []
        for spec in specs:
            t0 = time.perf_counter()
            m = learner.update(UpdateSpec.model_validate(spec), timeout_s=180)
            metrics.append(
                {k: m.get(k) for k in ("loss", "grad_norm", "optimizer_state", "learner_loaded", "zero_stage")}
            )
            metrics[-1]["wall_s"] = round(time.perf_counter() - t0, 2)
        actor = learner.actors[0]
        try:
            out["rank"] = ray.get(
                actor.__ray_call__.remote(
                    lambda rank: {
                        "engine_device": str(rank.worker.engine.device),
                        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                        "backend": __import__("torch.distributed", fromlist=["x"]).get_backend(),
                        "gpu_ids": ray.get_gpu_ids(),
                    }
                ),
                timeout=60,
            )
        except Exception as exc:  # __ray_call__ missing in this Ray: say so, the rest stands
            out["rank"] = {"error": str(exc)[:300]}
        out["where"] = learner.places
    finally:
        learner.stop()
        ray.shutdown()
    out["updates"] = metrics
    ok = metrics[1]["optimizer_state"] == "resident" and out["bundle"].get("GPU") == (1 if mode == "cuda" else None)
    reference = work / "out" / "s3-z3ckpt-u2" / "model"
    if reference.is_dir():
        out["distance_to_stage3"] = distance(work / "out" / "s6-u2" / "model", reference, model)
        ok = ok and verdict(out["distance_to_stage3"]["rel"]) == "pass"
        versus = f"rel {out['distance_to_stage3']['rel']:.2e} to stage 3's in-process run"
    else:
        versus = "stage 3 did not run: no reference"
    out["status"] = "pass" if ok else "fail"
    out["headline"] = (
        f"Ray learner, bundle {out['bundle']}, rank on {out.get('rank', {}).get('engine_device')} "
        f"({out.get('rank', {}).get('backend')}); updates {[m['optimizer_state'] for m in metrics]} in "
        f"{[m['wall_s'] for m in metrics]} s; {versus}"
    )
    return out


def stage_levers(work: Path, mode: str, args: Any) -> dict[str, Any]:
    """The update paths added after the first GPU run, on the device, each against the plain path (fp32, ZeRO-0,
    the model's own logits): the LM head at the loss positions only (the default), in chunks, under ZeRO-2;
    zero-advantage rows skipped vs trained; bf16 with and without fp32 master weights (reported, not judged:
    bf16 rounds). All runs at once, each its own process (the small model; the GPU holds them all)."""
    model = ensure_model(work, mode, "small")
    batch = write_batch(work / "batch-a.parquet", mode, "small", seed=1)
    zeros = write_batch(work / "batch-zeros.parquet", mode, "small", seed=3, zero_rows=4)
    own = {"head_at_loss_positions": False}
    runs = {  # name -> (batch, training settings, reference run or None)
        "own_logits": (batch, own, None),
        "loss_positions": (batch, {}, "own_logits"),
        "loss_positions_chunked": (batch, {"head_chunk_tokens": 16}, "own_logits"),
        "loss_positions_zero2": (batch, {"zero_stage": 2}, "own_logits"),
        "zeros_trained": (zeros, {}, None),
        "zeros_skipped": (zeros, {"skip_zero_advantage_rows": True}, "zeros_trained"),
        "bf16_fp32_master": (batch, {"dtype": "bf16"}, "own_logits"),
        "bf16_weights": (batch, {"dtype": "bf16", "master_weights": "bf16"}, "own_logits"),
    }
    threads = 2 if mode == "cuda" else 1
    procs = {
        name: start_job(work, f"lv-{name}", fp32_specs(work, mode, f"lv-{name}", b, model, **t), threads=threads)
        for name, (b, t, _) in runs.items()
    }
    results = {name: finish_job(proc) for name, proc in procs.items()}
    out: dict[str, Any] = {"runs": {}}
    judged, failed = [], []
    for name, (_, training, ref) in runs.items():
        res = results[name]
        entry: dict[str, Any] = {"training": training, "ok": res["ok"]}
        if not res["ok"]:
            entry["key_lines"] = res.get("key_lines")
            failed.append(name)
        else:
            metrics = res["updates"][0]["metrics"]
            entry.update(
                loss=metrics["loss"], grad_norm=metrics["grad_norm"], device=res["updates"][0]["engine_device"]
            )
            if ref and results[ref]["ok"]:
                entry["against"] = ref
                entry["distance"] = distance(
                    work / "out" / f"lv-{name}" / "model", work / "out" / f"lv-{ref}" / "model", model
                )
                if not name.startswith("bf16"):
                    judged.append((name, entry["distance"]["rel"]))
        out["runs"][name] = entry
    bad = [n for n, rel in judged if verdict(rel) != "pass"]
    out["status"] = "fail" if failed or bad or not judged else "pass"
    rels = ", ".join(f"{n} {rel:.1e}" for n, rel in judged)
    bf16 = ", ".join(
        f"{n} {out['runs'][n]['distance']['rel']:.2f}"
        for n in ("bf16_fp32_master", "bf16_weights")
        if "distance" in out["runs"][n]
    )
    out["headline"] = f"rel vs reference: {rels} (pass < {PASS_REL:g}); bf16 (not judged): {bf16}" + (
        f"; FAILED runs: {failed}" if failed else ""
    )
    return out


def stage_device_plan(work: Path, mode: str, args: Any) -> dict[str, Any]:
    """The device plan on the machine's real GPUs, by the path a run takes (``Runtime._choose_between_updates``
    and ``_plan_devices`` for the default ``code-env`` config, before any server starts): ``nvidia-smi -L`` as
    ``inference.server.gpu_ids`` reads it, ``between_updates: auto`` (one GPU for both: ``sleep``), the plan
    for one replica and one rank, the refusals for what one GPU cannot hold, and a child started with the
    replica's ``CUDA_VISIBLE_DEVICES`` as the runtime sets it sees exactly that GPU."""
    from pettingflow.configs.loader import load_config
    from pettingflow.inference.server import detect_device, gpu_ids
    from pettingflow.runs.device_plan import DevicePlanError
    from pettingflow.runs.runtime import Runtime

    out: dict[str, Any] = {"detect_device": detect_device(), "gpu_ids": gpu_ids()}
    device, ids = out["detect_device"], out["gpu_ids"]
    if device != "cuda":
        out.update(status="pass" if mode == "cpu" else "fail", headline=f"no GPU listed (device {device})")
        return out

    def plan_for(overrides: list[str]) -> tuple[Any, Any]:
        runtime = Runtime(load_config("code-env", overrides), "gpu-check")
        runtime.between_updates = runtime._choose_between_updates()
        return runtime.between_updates, runtime._plan_devices()

    chosen, plan = plan_for([])
    out["between_updates_auto"] = {"mode": chosen.mode, "reason": chosen.reason}
    out["plan_default"] = {"replicas": plan.replicas, "ranks": plan.ranks, "tp": plan.tensor_parallel}
    out["plan_default"]["shared"] = plan.shared
    refused: dict[str, str | None] = {}
    for what, overrides in {
        "two_replicas": ["inference.replicas=2", "inference.between_updates=sleep"],
        "two_ranks": ["training.num_processes=2", "inference.between_updates=sleep"],
        "keep_on_shared_gpu": ["inference.between_updates=keep"],
        "async_on_shared_gpu": ["rollout.async_rollouts=true"],
    }.items():
        try:
            plan_for(overrides)
            refused[what] = None
        except DevicePlanError as exc:
            refused[what] = str(exc)
    out["refused"] = refused
    gpus = ",".join(map(str, plan.replicas[0]))
    probe = "import torch; print(torch.cuda.device_count(), torch.cuda.get_device_name(0))"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=env)
    out["replica_child_sees"] = (child.stdout or child.stderr).strip()[-300:]
    one_gpu = len(ids) == 1
    ok = (
        chosen.mode == ("sleep" if one_gpu else chosen.mode)
        and plan.replicas[0] == (ids[0],)
        and plan.ranks[0] == ids[0]
        and (all(refused.values()) if one_gpu else True)
        and child.returncode == 0
        and out["replica_child_sees"].startswith("1 ")
    )
    out["status"] = "pass" if ok else "fail"
    out["headline"] = (
        f"GPUs {ids}; auto between_updates {chosen.mode}; plan replicas {plan.replicas} ranks {plan.ranks} "
        f"shared {plan.shared}; refused {sum(bool(v) for v in refused.values())}/{len(refused)}; replica child "
        f"sees {out['replica_child_sees']!r}"
    )
    return out


# ------------------------------------------------------------------------------------------------ MFU
MFU_GOAL = 0.40
# dense bf16 tensor-core peaks (no sparsity) from NVIDIA's datasheets, by a part of torch's device name; the first
# match wins, so the narrower names come first (GH200 matches "H200": the same chip's rate)
DATASHEET_BF16 = (
    ("H200 NVL", 835.5e12),
    ("H200", 989.5e12),
    ("H100 PCIe", 756.0e12),
    ("H100 NVL", 835.5e12),
    ("H100", 989.5e12),
    ("A100", 312.0e12),
)
MFU_ROWS = {"cuda": 64, "cpu": 8}  # rows per update
MFU_MINI = {"cuda": 32, "cpu": 4}  # rows per optimizer step: two steps per update
MFU_MATMUL_N = {"cuda": 8192, "cpu": 256}


def datasheet_peak(device_name: str) -> float | None:
    """The datasheet's dense bf16 FLOP/s of the GPU ``device_name`` names, or None when the table lacks it."""
    for part, peak in DATASHEET_BF16:
        if part.lower() in device_name.lower():
            return peak
    return None


def matmul_rate(n: int, device: str, iters: int = 20, repeats: int = 5) -> float:
    """FLOP/s of ``n x n x n`` bf16 matmuls on random data: the fastest of ``repeats`` timings of ``iters``
    back-to-back products (CUDA events on the GPU), after a warm-up."""
    import torch

    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    cuda = device == "cuda"
    for _ in range(iters):  # warm-up (and the clocks up)
        torch.matmul(a, b, out=c)
    best = math.inf
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(iters):
                torch.matmul(a, b, out=c)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                torch.matmul(a, b, out=c)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    del a, b, c
    return 2.0 * n**3 * iters / best


def old_logprob_rows(rows: int, mini: int, epochs: int) -> int:
    """Rows whose old log-probs the worker computes with a forward of its own: with one epoch the first window's
    are the training forward's (no step precedes it), so every window after the first; with more epochs, all."""
    return max(0, rows - mini) if epochs == 1 else rows


def update_flops(
    shape: dict[str, int],
    rows: int,
    seq: int,
    prompt: int,
    *,
    epochs: int = 1,
    logprob_rows: int = 0,
    checkpointing: bool = False,
    head_chunked: bool = False,
) -> dict[str, float]:
    """FLOPs of one update of ``rows`` rows of ``seq`` tokens (``prompt`` of them prompt, the rest trained), as
    the worker computes it (no shared prompts: every row runs whole; the LM head at the loss positions only).

    With ``N_dec = L (2 h^2 + 2 h kv + 3 h f)`` (q, o; k, v of ``kv = kv_heads * h / heads`` columns; gate, up,
    down) and ``N_head = V h`` (the tied embedding as the LM head), one forward of a row costs
    ``2 N_dec s + 2 N_head (s - p) + 2 L h s^2`` (``s = seq``, ``p = prompt``; the last term is attention's two
    ``s x s`` products over the ``h`` query columns, causal: half of the square). Then:

    - ``train`` = 3 forwards (forward + backward = 6 per weight per token) x rows x epochs;
    - ``logprob`` = 1 forward x ``logprob_rows`` (the old log-probs' own forward, ``old_logprob_rows``);
    - ``model`` = train + logprob: the work the algorithm needs, what MFU counts;
    - ``recompute`` = what checkpointing re-runs: the decoder's forward (``2 N_dec s + 2 L h s^2`` per row) and,
      with the head in chunks, the head's (``2 N_head (s - p)``), per epoch; ``hardware`` = model + recompute
      (HFU's numerator);
    - ``palm`` = model with attention counted over the whole square (PaLM's ``6 N + 12 L h s`` per token,
      which published MFU figures often use): the same time gives a slightly higher MFU by it.
    """
    layers, hidden = shape["layers"], shape["hidden"]
    kv = shape["kv_heads"] * (hidden // shape["heads"])
    n_dec = layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * shape["intermediate"])
    n_head = shape["vocab"] * hidden
    loss = seq - prompt
    decoder_fwd = 2.0 * n_dec * seq  # per row
    head_fwd = 2.0 * n_head * loss
    attention_fwd = 2.0 * layers * hidden * seq * seq
    row_fwd = decoder_fwd + head_fwd + attention_fwd
    train = 3 * row_fwd * rows * epochs
    logprob = row_fwd * logprob_rows
    recompute = 0.0
    if checkpointing:
        recompute += (decoder_fwd + attention_fwd) * rows * epochs
    if head_chunked:
        recompute += head_fwd * rows * epochs
    model = train + logprob
    attention_share = attention_fwd * (3 * rows * epochs + logprob_rows)
    return {
        "decoder_params": float(n_dec),
        "head_params": float(n_head),
        "tokens": float(rows * seq),
        "loss_tokens": float(rows * loss),
        "train": train,
        "logprob": logprob,
        "model": model,
        "recompute": recompute,
        "hardware": model + recompute,
        "attention": attention_share,
        "palm": model + attention_share,
    }


def mfu_cases(mode: str, micro: int) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """(the cases always run, the first one the reference; the levers, run when none of those reaches
    ``MFU_GOAL``), each a name -> training settings over bf16 with fp32 master weights: ZeRO-0 and ZeRO-2 (the
    config's default) without checkpointing, ``micro`` rows per micro-batch; the levers: checkpointing with twice
    the micro-batch (what fits once the activations are recomputed), and bf16 master weights (no fp32 copies:
    a lighter optimizer step). On the CPU (a test of the stage, not of a machine): ZeRO-0, and checkpointing as
    the lever, always run."""
    base = {"zero_stage": 0, "micro_batch_size": micro}
    ckpt = {"zero_stage": 0, "gradient_checkpointing": True, "micro_batch_size": 2 * micro}
    if mode != "cuda":
        return {f"z0_mb{micro}": base}, {f"z0_ckpt_mb{2 * micro}": ckpt}
    return (
        {f"z0_mb{micro}": base, f"z2_mb{micro}": {**base, "zero_stage": 2}},
        {f"z0_ckpt_mb{2 * micro}": ckpt, f"z0_bf16master_mb{micro}": {**base, "master_weights": "bf16"}},
    )


def mfu_case_summary(
    run: dict[str, Any],
    training: dict[str, Any],
    shape: dict[str, int],
    rows: int,
    seq: int,
    prompt: int,
    mini: int,
    peaks: dict[str, float],
) -> dict[str, Any]:
    """A case's figures from its second (warm, resident) update: time, FLOPs, MFU / HFU against each peak, the
    training pass's phases, memory; ``checks`` says whether the worker did the work the FLOPs assume."""
    updates = run["updates"]
    last = updates[-1]
    m = last["metrics"]
    timings = m.get("timings") or {}
    micro = training["micro_batch_size"]
    flops = update_flops(
        shape,
        rows,
        seq,
        prompt,
        logprob_rows=old_logprob_rows(rows, mini, 1),
        checkpointing=bool(training.get("gradient_checkpointing")),
        head_chunked=bool(training.get("head_chunk_tokens")),
    )
    duration = float(m["duration_s"])
    train_s, logprob_s = timings.get("train_s"), timings.get("logprob_s")
    out: dict[str, Any] = {
        "training": training,
        "update_s": [u["metrics"]["duration_s"] for u in updates],
        "setup_s": (updates[0]["metrics"].get("timings") or {}).get("setup_s"),
        "warm_update_s": duration,
        "train_s": train_s,
        "old_logprob_s": logprob_s,
        "other_s": round(duration - (train_s or 0) - (logprob_s or 0), 3),
        "tokens_per_s": round(flops["tokens"] / duration, 1),
        "flops": flops,
        "model_tflops_per_s": round(flops["model"] / duration / 1e12, 2),
        "mfu": {k: round(flops["model"] / duration / p, 4) for k, p in peaks.items()},
        "hfu": {k: round(flops["hardware"] / duration / p, 4) for k, p in peaks.items()},
        "mfu_palm": {k: round(flops["palm"] / duration / p, 4) for k, p in peaks.items()},
        "phases": last.get("phases"),
        "attn_implementation": last.get("attn_implementation"),
        "loss": [u["metrics"]["loss"] for u in updates],
        "optimizer_state": [u["metrics"]["optimizer_state"] for u in updates],
        "optimizer_steps": m.get("optimizer_steps"),
        "memory": [memory_of(u) for u in updates],
    }
    if train_s:
        out["train_pass_mfu"] = {k: round(flops["train"] / train_s / p, 4) for k, p in peaks.items()}
    out["checks"] = {
        "tokens": m.get("tokens") == rows * seq,
        "model_tokens": m.get("model_tokens") == rows * (seq - prompt),
        "old_logprob_forwards_skipped": m.get("old_logprob_forwards_skipped") == -(-min(mini, rows) // micro),
        "optimizer_steps": m.get("optimizer_steps") == -(-rows // mini),
        "resident": out["optimizer_state"][-1] == "resident",
    }
    return out


def stage_mfu(work: Path, mode: str, args: Any) -> dict[str, Any]:
    """The learner's update MFU on a 1.5B model: model FLOPs (``update_flops``) / (the warm update's wall time x
    the peak), against the datasheet's dense bf16 peak and an 8192^3 bf16 matmul measured here; the cases of
    ``mfu_cases`` one after the other (their times are compared), each its own process with two updates (the
    second resident and timed), the levers only while the stage's time allows."""
    import torch

    cuda = mode == "cuda"
    scale = float(os.environ.get("GPU_CHECK_TIMEOUT_SCALE", "1"))
    deadline = float(os.environ.get("GPU_CHECK_STAGE_DEADLINE") or time.time() + STAGE_TIMEOUT_S["mfu"] * scale)
    device = "cuda" if cuda else "cpu"
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None
    out["total_memory_gib"] = total_gib and round(total_gib, 1)
    n = MFU_MATMUL_N[mode]
    iters, repeats = (20, 5) if cuda else (4, 3)
    measured = matmul_rate(n, device, iters=iters, repeats=repeats)
    peaks = {"measured_matmul": measured}
    sheet = datasheet_peak(out["device"]) if cuda else None
    if sheet:
        peaks = {"datasheet": sheet, **peaks}
    out["peaks_tflops"] = {k: round(v / 1e12, 3) for k, v in peaks.items()}
    out["matmul"] = f"bf16 {n}^3 on random data, the fastest of {repeats} runs of {iters} products"
    say(f"  peaks: {out['peaks_tflops']} TFLOP/s ({out['device']})")
    shape = SHAPES[mode]["mfu"]
    seq, prompt = SEQ[mode]["mfu"]
    rows, mini = MFU_ROWS[mode], MFU_MINI[mode]
    model = ensure_model(work, mode, "mfu", dtype="bf16", device=device)
    if cuda:
        torch.cuda.empty_cache()
    out["params"] = json.loads((model / "params.json").read_text())["params"]
    out["shape"], out["rows"], out["seq"], out["prompt"], out["mini_batch"] = shape, rows, seq, prompt, mini
    batch = write_batch(work / "batch-mfu.parquet", mode, "mfu", seed=5, rows=rows)
    micro = (8 if total_gib and total_gib >= 120 else 4) if cuda else 2
    runs: dict[str, Any] = {}
    cases: dict[str, Any] = {}
    skipped: list[str] = []
    walls: list[float] = []  # of the cases run: the next one is expected to take 1.15 x the longest

    def run_case(name: str, training: dict[str, Any]) -> bool:
        estimate = 1.15 * max(walls) if walls else 80.0
        left = deadline - time.time()
        if left < estimate + 15:
            skipped.append(name)
            say(f"  mfu case {name}: skipped ({left:.0f} s left, a case takes ~{estimate:.0f} s)")
            return False
        t = {"dtype": "bf16", "mini_batch_size": mini, "epochs": 1, "lr": 1e-5, **training}
        out_dir = work / "out" / f"mfu-{name}"
        specs = [
            spec_dict(batch, out_dir, model, seq, training=t),
            spec_dict(batch, out_dir, model, seq, training=t, start_version="u1", version="u2"),
        ]
        timeout = max(30.0, min(150.0, left - 10)) / scale
        res = finish_job(
            start_job(work, f"mfu-{name}", specs, threads=4, skip_save=True, phases=True, timeout_s=timeout)
        )
        runs[name] = res
        walls.append(res["wall_s"])
        if not res["ok"]:
            return False
        cases[name] = mfu_case_summary(res, training, shape, rows, seq, prompt, mini, peaks)
        c = cases[name]
        say(
            f"  mfu case {name}: warm update {c['warm_update_s']} s, MFU {c['mfu']}, HFU {c['hfu']}, "
            f"{c['tokens_per_s']:.0f} tok/s, phases {c['phases']}"
        )
        return True

    def out_of_memory(res: dict[str, Any]) -> bool:
        text = " ".join(res.get("key_lines") or []) + res.get("log_tail", "")
        return "out of memory" in text.lower()

    while True:  # the reference case; out of memory: every case with half the micro-batch
        base, levers = mfu_cases(mode, micro)
        first = next(iter(base))
        if run_case(first, base.pop(first)) or micro == 1 or not out_of_memory(runs.get(first, {})):
            break
        micro //= 2
        say(f"  mfu case {first} ran out of memory: micro-batch {micro} for every case")
    for name, training in base.items():
        run_case(name, training)
    key = "datasheet" if "datasheet" in peaks else "measured_matmul"
    best = max(cases, key=lambda c: cases[c]["mfu"][key], default=None)
    ran_levers = not cuda or (best is not None and cases[best]["mfu"][key] < MFU_GOAL)
    if ran_levers:
        for name, training in levers.items():
            run_case(name, training)
    best = max(cases, key=lambda c: cases[c]["mfu"][key], default=None)
    out.update(runs=runs, cases=cases, skipped_for_time=skipped, micro_batch=micro, levers_run=ran_levers)
    out["goal"] = f"MFU >= {MFU_GOAL} of the {key.replace('_', ' ')} peak"
    checks_ok = all(all(c["checks"].values()) for c in cases.values())
    failed = sorted(set(runs) - set(cases))
    if best is None:
        out["status"] = "fail"
        out["headline"] = "no case ran: " + "; ".join(f"{n}: {(runs[n].get('key_lines') or ['?'])[0]}" for n in failed)
        out["headline"] += f"; skipped for time: {skipped}" if skipped else ""
        return out
    out["best"] = {"case": best, "mfu": cases[best]["mfu"][key]}
    out["goal_met"] = cases[best]["mfu"][key] >= MFU_GOAL
    ok = checks_ok and (out["goal_met"] if cuda else True)
    out["status"] = "pass" if ok else "fail"
    params = out["params"]
    parts = [
        (f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M")
        + f" params, {rows} rows x {seq} tokens (prompt {prompt}), {-(-rows // mini)} optimizer steps, peaks "
        f"{out['peaks_tflops']} TFLOP/s"
    ]
    for name, c in cases.items():
        mem = c["memory"][-1]
        peak_mem = mem.get("max_memory_allocated_gib", mem.get("max_rss_bytes_gib"))
        ph = c["phases"] or {}
        split = "/".join(f"{ph.get(k, 0):.2f}" for k in ("forward", "head_loss", "backward", "optimizer_step"))
        parts.append(
            f"{name}: MFU {c['mfu'][key]:.3f} (vs matmul {c['mfu']['measured_matmul']:.3f}), HFU {c['hfu'][key]:.3f}, "
            f"update {c['warm_update_s']} s (old log-probs {c['old_logprob_s']}, train {c['train_s']} = fwd/head+loss/"
            f"bwd/opt {split}), {c['tokens_per_s']:.0f} tok/s, peak {peak_mem} GiB"
        )
    verdict_text = "met" if out["goal_met"] else "NOT met"
    parts.append(f"goal {out['goal']}: {verdict_text if cuda else 'not judged on the CPU'} (best {best})")
    if failed:
        parts.append("FAILED: " + ", ".join(f"{n} ({(runs[n].get('key_lines') or ['?'])[0][:160]})" for n in failed))
    if skipped:
        parts.append(f"skipped for time: {skipped}")
    if not checks_ok:
        parts.append(f"work differs from the FLOP count's assumptions: {[(n, c['checks']) for n, c in cases.items()]}")
    out["headline"] = "; ".join(parts)
    return out


STAGE_FUNCS = {
    "env": stage_env,
    "cpu_vs_gpu_fp32": stage_cpu_vs_gpu,
    "zero3_ckpt_vs_zero0": stage_zero3,
    "two_ranks_one_gpu": stage_two_ranks,
    "bf16_lora": stage_bf16_lora,
    "resident_learner": stage_resident_learner,
    "levers": stage_levers,
    "device_plan": stage_device_plan,
    "zero3_head": stage_zero3_head,
    "mfu": stage_mfu,
}


def run_stage_child(name: str, work: Path, mode: str) -> int:
    """``--stage NAME``: one stage in this (child) process; its result in ``stage-NAME.json``."""
    try:
        result = STAGE_FUNCS[name](work, mode, None)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        result = {"status": "error", "key_lines": [f"{type(exc).__name__}: {exc}"]}
    (work / f"stage-{name}.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


# ------------------------------------------------------------------------------------------------ pettingflow import
def pettingflow_path(work: Path) -> str | None:
    """Where ``pettingflow.training`` comes from for the children: installed (``/tmp/pf`` or a venv), or else a
    symlink tree of pyproject's ``[tool.setuptools.package-dir]`` built here (what an editable install does)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import pettingflow.training.launch, pettingflow.configs; print('ok')"],
        capture_output=True,
        text=True,
        cwd=work,
        env=child_env(1),
    )
    if probe.returncode == 0:
        return None
    import tomllib

    repo = common.REPO
    dirs = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    root = work / "pfsrc"
    shutil.rmtree(root, ignore_errors=True)
    top = root / "pettingflow"
    top.mkdir(parents=True)
    for item in (repo / dirs["pettingflow"]).iterdir():
        (top / item.name).symlink_to(item)
    for package, folder in sorted(dirs.items()):
        if package == "pettingflow":
            continue
        link = root / Path(*package.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(repo / folder)
    return str(root)


# ------------------------------------------------------------------------------------------------ main
class Tee:
    def __init__(self, path: Path):
        self.file = open(path, "a")  # noqa: SIM115 - lives as long as the run
        self.stdout = sys.stdout

    def write(self, text: str) -> int:
        self.file.write(text)
        self.file.flush()
        return self.stdout.write(text)

    def flush(self) -> None:
        self.file.flush()
        self.stdout.flush()


def stream(proc: subprocess.Popen[str], prefix: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        print(f"{prefix}{line.rstrip()}", flush=True)


def summary_line(name: str, res: dict[str, Any]) -> str:
    status = res.get("status", "error").upper()
    if status in ("SKIPPED", "TIMEOUT", "ERROR"):
        text = "; ".join(res.get("key_lines") or [])[:600] or "see gpu_check.json"
    elif name == "env":
        if res.get("device_name"):
            text = (
                f"{res.get('device_name')} cc {res.get('capability')}, torch {res.get('torch')} (CUDA "
                f"{res.get('torch_cuda')}), NCCL {res.get('nccl')}, deepspeed {res['versions']['deepspeed']}, "
                f"transformers {res['versions']['transformers']}, peft {res['versions']['peft']}"
            )
        else:
            text = f"no CUDA; torch {res.get('torch')}, deepspeed {(res.get('versions') or {}).get('deepspeed')}"
        if res.get("import_errors"):
            text += f"; import errors: {res['import_errors']}"
    else:
        text = res.get("headline") or "; ".join(res.get("key_lines") or []) or "see gpu_check.json"
        if not res.get("headline"):
            failed = [v for v in res.values() if isinstance(v, dict) and v.get("key_lines")]
            if failed:
                text = "; ".join(f["key_lines"][0] for f in failed)[:600]
    return f"{name:<22} {status:<7} {text}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run-job"]:
        return run_job(argv[1])
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT"), help="results folder (default $OUT)")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget for all stages")
    parser.add_argument("--work", type=Path, help="work folder (default: a temp folder, removed unless --keep)")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stage:
        return run_stage_child(args.stage, args.work, args.device)
    if args.out is None:
        parser.error("--out or $OUT is required")
    args.out.mkdir(parents=True, exist_ok=True)
    sys.stdout = Tee(args.out / "gpu_check.log")  # type: ignore[assignment]
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    say(f"gpu_check --device {args.device}: stages {args.stages}, budget {args.budget_s:.0f} s, work {work}")
    pf = pettingflow_path(work)
    if pf:
        # for the children only (child_env copies os.environ): this process imports nothing from pettingflow
        # but deathsig and hardware, which live in the source folder pettingflow/ that `python -m` from the repo
        # root already finds; the stages, in children, need the whole package.
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (pf, os.environ.get("PYTHONPATH", "")) if p)
        say(f"pettingflow is not importable as installed: using a symlink tree of the source at {pf}")
    record: dict[str, Any] = {
        "device_mode": args.device,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": os.uname().nodename,
        "pettingflow_source": pf or "installed",
        "stages": {},
    }
    scale = 1 if args.device == "cuda" else 4  # tiny models, but few CPU cores
    os.environ["GPU_CHECK_TIMEOUT_SCALE"] = str(scale)
    os.environ["GPU_CHECK_STARTED"] = str(STARTED)
    deadline = time.perf_counter() + args.budget_s
    for name in args.stages:
        left = deadline - time.perf_counter()
        if left < 20:
            record["stages"][name] = {"status": "skipped", "key_lines": ["out of the time budget"]}
            say(f"stage {name}: SKIPPED (budget spent)")
            continue
        timeout = min(STAGE_TIMEOUT_S[name] * scale, left)
        say(f"stage {name}: start (timeout {timeout:.0f} s)")
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", MODULE, "--stage", name, "--work", str(work), "--device", args.device]
        stage_deadline = {"GPU_CHECK_STAGE_DEADLINE": str(time.time() + timeout)}  # a stage may plan its runs by it
        proc = subprocess.Popen(
            with_parent(cmd),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=child_env(4, extra=stage_deadline),
            cwd=work,
            start_new_session=True,
        )
        reader = threading.Thread(target=stream, args=(proc, f"  {name} | "), daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc)
            proc.wait()
        reader.join(timeout=5)
        path = work / f"stage-{name}.json"
        if path.is_file() and not timed_out:
            res = json.loads(path.read_text())
        else:
            log_text = (args.out / "gpu_check.log").read_text(errors="replace")
            mine = "\n".join(ln.split("| ", 1)[-1] for ln in log_text.splitlines() if f"  {name} | " in ln)
            res = {
                "status": "timeout" if timed_out else "error",
                "key_lines": key_lines(mine),
                "log_tail": mine[-3000:],
            }
            if timed_out:
                res["key_lines"].insert(0, f"stage timed out after {timeout:.0f} s")
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        record["stages"][name] = res
        say(f"stage {name}: {res.get('status', 'error').upper()} in {res['wall_s']} s")
        (args.out / "gpu_check.json").write_text(json.dumps(record, indent=1, default=str))
    record["total_s"] = round(time.time() - STARTED, 1)
    record["summary"] = [summary_line(n, r) for n, r in record["stages"].items()]
    (args.out / "gpu_check.json").write_text(json.dumps(record, indent=1, default=str))
    runs_log = work / "runs.log"
    if runs_log.is_file():
        data = runs_log.read_bytes()
        (args.out / "runs.log").write_bytes(data[-12 * 2**20 :])
    print()
    say(f"summary ({args.device}, {record['total_s']:.0f} s):")
    for line in record["summary"]:
        print("  " + line, flush=True)
    print(f"results: {args.out / 'gpu_check.json'}", flush=True)
    if not args.keep and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
