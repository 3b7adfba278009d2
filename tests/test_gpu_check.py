"""bench/gpu_check.py's stage ``mfu``: its FLOP count against hand computations, the peak table, the phase clock,
and the stage itself in ``--device cpu`` mode (a tiny model; the goal is not judged there)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import common
from bench.gpu_check import (
    SHAPES,
    PhaseClock,
    datasheet_peak,
    mfu_cases,
    old_logprob_rows,
    update_flops,
)
from pettingflow.roofline import ModelShape

QWEN15 = SHAPES["cuda"]["mfu"]


def test_flops_of_a_tiny_shape_by_hand() -> None:
    shape = {"layers": 2, "hidden": 8, "intermediate": 16, "heads": 2, "kv_heads": 1, "vocab": 10}
    # kv = 1 head x 8/2 = 4 columns; per layer q, o 8x8, k, v 8x4, gate, up, down 8x16: 128 + 64 + 384 = 576
    f = update_flops(shape, rows=3, seq=5, prompt=2, logprob_rows=1)
    assert f["decoder_params"] == 2 * 576 and f["head_params"] == 80
    # one row's forward: 2 x 1152 x 5 tokens + 2 x 80 x 3 loss tokens + attention 2 x 2 layers x 8 x 5^2
    row = 11520 + 480 + 800
    assert f["train"] == 3 * row * 3 and f["logprob"] == row and f["model"] == 10 * row
    assert f["recompute"] == 0 and f["hardware"] == f["model"]
    assert f["attention"] == 800 * 10 and f["palm"] == f["model"] + 8000  # the masked half of the square too
    assert (f["tokens"], f["loss_tokens"]) == (15, 9)
    ckpt = update_flops(shape, rows=3, seq=5, prompt=2, logprob_rows=1, checkpointing=True)
    assert ckpt["model"] == f["model"] and ckpt["recompute"] == (11520 + 800) * 3  # the decoder's forward again
    chunked = update_flops(shape, rows=3, seq=5, prompt=2, logprob_rows=1, checkpointing=True, head_chunked=True)
    assert chunked["recompute"] == (11520 + 800 + 480) * 3 and chunked["hardware"] == 10 * row + chunked["recompute"]
    two = update_flops(shape, rows=3, seq=5, prompt=2, epochs=2, logprob_rows=3)
    assert two["train"] == 2 * f["train"] and two["logprob"] == 3 * row


def test_flops_of_the_qwen_shape_are_6nt_plus_attention() -> None:
    # Qwen2.5-1.5B as a Llama: 28 x (2 x 1536^2 + 2 x 1536 x 256 + 3 x 1536 x 8960) + 151936 x 1536
    n_dec, n_head = 28 * 46_792_704, 233_373_696
    f = update_flops(QWEN15, rows=64, seq=2048, prompt=256, logprob_rows=32)
    assert (f["decoder_params"], f["head_params"]) == (n_dec, n_head)
    config = {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
    }
    assert n_dec + n_head == ModelShape.from_config(config).matmul_params  # the roofline's N, head included
    tokens, loss_tokens = 64 * 2048, 64 * 1792
    attention = 6 * 28 * 1536 * 2048**2 * 64  # fwd + bwd, causal half of 12 L h s^2 per row
    assert f["train"] == 6 * n_dec * tokens + 6 * n_head * loss_tokens + attention
    assert f["logprob"] == pytest.approx(f["train"] / 6)  # half the rows, one forward of three
    assert 1.46e15 < f["model"] < 1.48e15


def test_old_logprob_rows_and_cases() -> None:
    assert old_logprob_rows(64, 32, 1) == 32  # the first window's come from its training forward
    assert old_logprob_rows(64, 64, 1) == 0
    assert old_logprob_rows(8, 4, 2) == 8
    base, levers = mfu_cases("cuda", 8)
    assert list(base) == ["z0_mb8", "z2_mb8"] and base["z2_mb8"]["zero_stage"] == 2
    assert levers["z0_ckpt_mb16"] == {"zero_stage": 0, "gradient_checkpointing": True, "micro_batch_size": 16}
    assert levers["z0_bf16master_mb8"]["master_weights"] == "bf16"
    assert [list(d) for d in mfu_cases("cpu", 2)] == [["z0_mb2"], ["z0_ckpt_mb4"]]


def test_datasheet_peaks_by_device_name() -> None:
    assert datasheet_peak("NVIDIA H200") == 989.5e12
    assert datasheet_peak("NVIDIA H100 80GB HBM3") == 989.5e12
    assert datasheet_peak("NVIDIA GH200 480GB") == 989.5e12
    assert datasheet_peak("NVIDIA H100 PCIe") == 756e12
    assert datasheet_peak("NVIDIA H200 NVL") == 835.5e12
    assert datasheet_peak("Tesla T4") is None


def test_phase_clock_splits_micro_batches() -> None:
    class Engine:
        def __init__(self) -> None:
            self.calls = 0

        def forward(self, x: int) -> int:
            return x + 1

        def backward(self, loss: int) -> None:
            pass

        def is_gradient_accumulation_boundary(self) -> bool:
            return self.calls % 2 == 1

        def step(self) -> None:
            self.calls += 1

    engine, clock = Engine(), PhaseClock(cuda=False)
    clock.wrap(engine)
    clock.wrap(engine)  # once only
    for _ in range(4):
        assert engine.forward(1) == 2
        engine.backward(0)
        engine.step()
    phases = clock.read()
    assert phases["micro_batches"] == 4 and engine.calls == 4
    assert set(phases) >= {"forward", "backward", "optimizer_step", "step_other", "head_loss", "micro_batch_total"}
    parts = sum(phases[k] for k in ("forward", "backward", "optimizer_step", "step_other", "head_loss"))
    assert parts == pytest.approx(phases["micro_batch_total"], abs=1e-3)
    assert clock.read() == {"micro_batches": 0}


@pytest.mark.slow
def test_mfu_stage_runs_on_the_cpu(tmp_path) -> None:
    """The documented ``--device cpu`` run of the stage: both cases run the worker (two updates, the second
    resident) and their figures and checks are recorded; about 45 s (two DeepSpeed processes)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--stages", "mfu", "--out", str(out)]
    res = subprocess.run(cmd, cwd=common.REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    stage = json.loads((out / "gpu_check.json").read_text())["stages"]["mfu"]
    assert stage["status"] == "pass", stage.get("headline") or stage.get("key_lines")
    assert list(stage["cases"]) == ["z0_mb2", "z0_ckpt_mb4"] and not stage["skipped_for_time"]
    for name, case in stage["cases"].items():
        assert all(case["checks"].values()), (name, case["checks"])
        assert case["optimizer_state"] == ["new", "resident"] and case["mfu"]["measured_matmul"] > 0
        assert case["phases"]["micro_batches"] == 8 // case["training"]["micro_batch_size"]
    ckpt = stage["cases"]["z0_ckpt_mb4"]
    assert ckpt["flops"]["recompute"] > 0 and ckpt["hfu"]["measured_matmul"] > ckpt["mfu"]["measured_matmul"]
    assert "not judged on the CPU" in stage["headline"]
