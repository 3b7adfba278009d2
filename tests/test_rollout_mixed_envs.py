"""One batch, several envs: rows name their env class and config; factories are cached."""

from __future__ import annotations

import asyncio

import pytest
from rollout_fakes import CharChatTokenizer, ScriptedLLM, ToyAgent

from pettingflow.configs import load_config
from pettingflow.envs import EnvCache
from pettingflow.rollout.engine import AgentBinding, ExecutionEngine
from pettingflow.rollout.local import episode_specs
from pettingflow.rollout.records import build_rows
from pettingflow.steps.rollouts import task_id

TOK = CharChatTokenizer()


def row(label: str, tid: str) -> dict:
    return {"env_class_path": "rollout_fakes:BoardEnv", "env_config": {"label": label}, "task_data": {"task_id": tid}}


def test_mixed_env_rows_run_in_their_own_envs_with_one_factory_per_spec() -> None:
    config = load_config("code-env")
    cache = EnvCache()
    tasks = [row("x", "A"), row("y", "B"), row("x", "C")]
    specs = episode_specs(config, tasks, group_size=2, seed_namespace="t/", env_cache=cache)
    assert [s.id.env_name for s in specs] == ["rollout_fakes:BoardEnv"] * 6
    created = []
    original = specs[0].make_env

    def make_env(spec):
        env = original(spec)
        created.append(env)
        return env

    specs = [s.__class__(**{**s.__dict__, "make_env": make_env}) for s in specs]
    llm = ScriptedLLM(TOK)
    bindings = {n: AgentBinding(client=llm, served_model=n, tokenizer=TOK, policy_name="shared") for n in ("a", "b")}
    engine = ExecutionEngine(
        lambda: [ToyAgent(n, TOK, "per_turn") for n in ("a", "b")],
        bindings,
        max_turns=2,
        token_budget=100,
        show_progress=False,
    )
    records, _ = asyncio.run(engine.run(specs))
    assert [e.config.label for e in created] == ["x", "x", "y", "y", "x", "x"]
    assert [e.task["task_id"] for e in created] == ["A", "A", "B", "B", "C", "C"]
    assert len(cache) == 2  # (BoardEnv, label x) and (BoardEnv, label y)
    rows = build_rows(records, "per_turn", "r", 0, 2)
    assert {r["env_name"] for r in rows} == {"rollout_fakes:BoardEnv"}
    assert [task_id(t, i) for i, t in enumerate(tasks)] == ["A", "B", "C"]


def test_bare_tasks_use_the_configured_env() -> None:
    config = load_config("code-env")
    specs = episode_specs(config, [{"task_id": "T"}], group_size=2, seed_namespace="", env_cache=EnvCache())
    assert [s.id.env_name for s in specs] == ["code-env", "code-env"]
    assert specs[0].task.env.class_path.endswith(":CodeEnv")


def test_shipped_mixed_dataset_runs_each_env_with_its_own_team() -> None:
    """configs/mixed-envs.yaml: one batch of code-env, plan-path and math-tool rows from the shipped file;
    agents[].envs gives each env its team, so code episodes see only the code agents, grids only the planner
    and executor, problems only the tool and the reasoner (real agents and envs; a fake sandbox and a scripted
    LLM). The step's statistics and the report split them by env."""
    from test_code_env import FakeSandbox
    from test_math_tool import FakeSandbox as FakeMathSandbox

    from pettingflow.agents.base import build_agent
    from pettingflow.envs import EnvFactory, load_tasks
    from pettingflow.rollout.engine import summarize
    from pettingflow.steps.report import iteration_metrics
    from pettingflow.steps.rollouts import stats_metrics

    config = load_config("mixed-envs")
    train = load_tasks(config.env.dataset).train
    tasks = [next(t for t in train if t["env_class_path"] == env) for env in ("code-env", "plan-path", "math-tool")]

    def make_factory(spec):
        if spec.class_path.endswith(":CodeEnv"):
            return EnvFactory(spec, shared={"sandbox": FakeSandbox()})
        if spec.class_path.endswith(":MathToolEnv"):  # every program "prints" 3
            return EnvFactory(spec, shared={"sandbox": FakeMathSandbox(stdout="3\n")})
        return EnvFactory(spec)

    cache = EnvCache(make_factory)
    specs = episode_specs(config, tasks, group_size=2, seed_namespace="t/", env_cache=cache)
    replies = {
        "planner": "moves: R",
        "executor": "moves: R",
        "code_generator": "def f(): pass",
        "test_generator": "",
        "tool": "```python\nprint(3)\n```",
        "reasoner": "Answer: 3",
    }
    llm = ScriptedLLM(TOK, reply=lambda model, prompt, params: replies[model])
    names = [a.name for a in config.agents]
    bindings = {n: AgentBinding(client=llm, served_model=n, tokenizer=TOK, policy_name="shared") for n in names}
    engine = ExecutionEngine(
        lambda: [build_agent(a, agent_idx=i, tokenizer=TOK) for i, a in enumerate(config.agents)],
        bindings,
        max_turns=config.env.max_turns,
        token_budget=config.env.token_budget,
        show_progress=False,
    )
    records, stats = asyncio.run(engine.run(specs))
    rows = build_rows(records, "per_turn", "r", 0, 2)
    acted = {(r["env_name"], r["agent_name"]) for r in rows}
    assert acted == {
        ("code-env", "code_generator"),
        ("code-env", "test_generator"),
        ("plan-path", "planner"),
        ("plan-path", "executor"),
        ("math-tool", "tool"),
        ("math-tool", "reasoner"),
    }
    plan_turns = [(r["turn_idx"], r["agent_name"], r["agent_idx"]) for r in rows if r["env_idx"] == 1]
    assert plan_turns[:2] == [(0, "planner", 0), (1, "executor", 1)] * 1  # the team's own order and positions
    math_turns = [(r["turn_idx"], r["agent_name"], r["agent_idx"]) for r in rows if r["env_idx"] == 2]
    assert math_turns[:2] == [(0, "tool", 0), (1, "reasoner", 1)]
    assert len(cache) == 3
    # every group is one task, so one env: its UID never spans two envs
    envs_of_uid = {}
    for r in rows:
        envs_of_uid.setdefault(r["uid"], set()).add(r["env_name"])
    assert all(len(e) == 1 for e in envs_of_uid.values())
    # per env: episodes, tokens and each of its agents' scores (the same numbers as the totals, split)
    per_env = summarize(records).per_env
    assert stats.per_env == per_env and set(per_env) == {"code-env", "plan-path", "math-tool"}
    assert [per_env[e]["episodes"] for e in ("code-env", "plan-path", "math-tool")] == [2, 2, 2]
    assert sum(v["tokens_generated"] for v in per_env.values()) == stats.tokens_generated
    assert set(per_env["math-tool"]["agents"]) == {"tool", "reasoner"}
    assert per_env["math-tool"]["agents"]["reasoner"] == stats.per_agent["reasoner"]
    report = iteration_metrics({"rollouts": {"metrics": stats_metrics(stats)}}, {})
    assert report["rollouts/env/math-tool/episodes"] == 2.0
    assert report["rollouts/env/plan-path/executor/success_rate"] == stats.per_agent["executor"]["success_rate"]
    assert "rollouts/env/code-env/code_generator/reward_mean" in report
    one_env = summarize([r for r in records if r.id.env_name == "plan-path"])
    assert "envs" not in stats_metrics(one_env)  # a step of one env: its totals are the env's


def test_an_env_without_a_team_fails_clearly() -> None:
    config = load_config("mixed-envs")
    from pettingflow.agents.base import build_agent

    coders = [a for a in config.agents if a.envs == ["code-env"]]
    llm = ScriptedLLM(TOK)
    engine = ExecutionEngine(
        lambda: [build_agent(a, agent_idx=i, tokenizer=TOK) for i, a in enumerate(coders)],
        {a.name: AgentBinding(client=llm, served_model=a.name, tokenizer=TOK, policy_name="shared") for a in coders},
        max_turns=2,
        token_budget=100,
        show_progress=False,
    )
    grid = {"env_class_path": "plan-path", "task_data": {"task_id": "p", "seed": 1}}
    specs = episode_specs(config, [grid], group_size=1, seed_namespace="", env_cache=EnvCache())
    with pytest.raises(
        ValueError, match=r"no configured agent acts in PlanPathEnv .*add that env to some agent's 'envs'"
    ):
        asyncio.run(engine.run(specs))
