"""The roofline's arithmetic, the report's roofline metrics from a cached probe, and the probe's cache."""

from __future__ import annotations

import json

import pytest

from pettingflow import hardware_probe
from pettingflow.configs.loader import load_config
from pettingflow.roofline import ModelShape, decode_bound, model_shape_peak, train_flops, update_fraction
from pettingflow.steps.report import roofline_metrics

SMOLLM2 = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}


def test_smollm2_weights_and_flops() -> None:
    shape = ModelShape.from_config(SMOLLM2)
    # SmolLM2-135M: 134.5 M parameters with tied embeddings; every one of them multiplies (the head is the embedding)
    assert shape.matmul_params == 134_479_872 and 134_000_000 < shape.weights < 135_000_000
    assert train_flops(shape, 1000) == 6 * shape.matmul_params * 1000
    assert train_flops(shape, 1000, checkpointing=True) == 8 * shape.matmul_params * 1000
    head = 49152 * 576
    assert train_flops(shape, 1000, head_tokens=0) == 6 * (shape.matmul_params - head) * 1000
    assert sum(shape.shape_weights().values()) == shape.matmul_params
    with pytest.raises(ValueError, match="lacks"):
        ModelShape.from_config({"hidden_size": 8})


def test_peak_weights_each_shape_by_its_time() -> None:
    shape = ModelShape.from_config(SMOLLM2)
    even = dict.fromkeys(shape.shape_weights(), 1e12)
    assert model_shape_peak(shape, even) == pytest.approx(1e12)
    slow_head = {**even, "lm head": 0.25e12}  # the head is 21 % of the FLOPs: it takes ~52 % of the time
    share = shape.shape_weights()["lm head"] / shape.matmul_params
    assert model_shape_peak(shape, slow_head) == pytest.approx(1e12 / ((1 - share) + share * 4))
    with pytest.raises(ValueError, match="hardware probe --force"):
        model_shape_peak(shape, {"large": 1e12})
    achieved, fraction = update_fraction(shape, 1000.0, 2e12)
    assert achieved == train_flops(shape, 1000.0) and fraction == pytest.approx(achieved / 2e12)


def test_decode_bound_reads_the_weights_once_per_step() -> None:
    shape = ModelShape.from_config(SMOLLM2)
    one = decode_bound(shape, "bf16", 20e9, 1)
    assert one == pytest.approx(20e9 / (2 * shape.weights)) and decode_bound(shape, "fp32", 20e9, 1) == one / 2
    assert decode_bound(shape, "bfloat16", 20e9, 8) == pytest.approx(8 * one)


def test_report_metrics_from_a_cached_probe(tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2))
    config = load_config("code-env", [f"policies.0.model={model}", "training.dtype=bf16", "inference.dtype=bfloat16"])
    shape = ModelShape.from_config(SMOLLM2)
    probe = {"matmul_flops": {"bf16": dict.fromkeys(shape.shape_weights(), 1e12)}, "bandwidth": 20e9}
    metrics = {
        "update/shared/tokens_per_s": 400.0,
        "update/shared/model_tokens_per_s": 100.0,
        "rollouts/tokens_per_s": 50.0,
        "rollouts/episodes": 16.0,
    }
    out = roofline_metrics(config, metrics, probe)
    flops = train_flops(shape, 400.0, 100.0)  # an update that reports no computed tokens: its padded rows' tokens
    assert out["roofline/update/shared/tflops"] == round(flops / 1e12, 4)
    out = roofline_metrics(config, {**metrics, "update/shared/computed_tokens_per_s": 300.0}, probe)
    flops = train_flops(shape, 300.0, 100.0)  # a shared prompt computed once: the tokens the forward ran
    assert out["roofline/update/shared/tflops"] == round(flops / 1e12, 4)
    assert out["roofline/update/shared/fraction_of_peak"] == round(flops / 1e12, 4)
    bound = decode_bound(shape, "bf16", 20e9, 16)
    assert out["roofline/generation/fraction_of_bound"] == round(50.0 / bound, 4)
    assert roofline_metrics(config, metrics, None) == {}  # no probe on this machine: nothing, no probing
    assert roofline_metrics(config, {}, probe) == {}


def test_the_probe_is_cached_per_machine(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PETTINGFLOW_HOME", str(tmp_path))
    assert hardware_probe.load(1) is None
    tiny = ModelShape(hidden=64, intermediate=128, layers=1, heads=4, kv_heads=2, vocab=256)
    monkeypatch.setattr(hardware_probe, "LARGE", 128)
    monkeypatch.setattr(hardware_probe, "copy_bandwidth", lambda **kw: 1e9)
    result = hardware_probe.probe(tiny, threads=1, tokens=16, progress=lambda line: None)
    assert set(result["matmul_flops"]) == {"bf16", "fp32"}
    assert set(result["matmul_flops"]["bf16"]) == {"large", *tiny.matmul_shapes(16)}
    assert all(v > 0 for v in result["matmul_flops"]["fp32"].values())
    path = hardware_probe.save(result)
    assert path.parent == tmp_path / "hardware" and hardware_probe.load(1) == result
    assert hardware_probe.load(2) is None  # another thread count is another probe
