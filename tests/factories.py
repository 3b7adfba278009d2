"""Small builders of valid trajectory rows for tests."""

from __future__ import annotations

import json
from typing import Any


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
