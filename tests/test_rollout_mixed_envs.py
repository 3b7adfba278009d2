"""One batch, several envs (seed 001): rows name their env class and config; factories are cached."""

from __future__ import annotations

import asyncio

from rollout_fakes import CharChatTokenizer, ScriptedLLM, ToyAgent

from pettingflow.configs import load_config
from pettingflow.envs import EnvCache
from pettingflow.iteration.rollouts import episode_specs, task_id
from pettingflow.rollout.engine import AgentBinding, ExecutionEngine
from pettingflow.rollout.records import build_rows

TOK = CharChatTokenizer()


def row(label: str, tid: str) -> dict:
    return {"env_class_path": "rollout_fakes:BoardEnv", "env_config": {"label": label}, "task_data": {"task_id": tid}}


def test_mixed_env_rows_run_in_their_own_envs_with_one_factory_per_spec() -> None:
    config = load_config("code-env")
    cache = EnvCache()
    tasks = [row("x", "A"), row("y", "B"), row("x", "C")]
    specs = episode_specs(config, tasks, group_size=2, seed_namespace="t/", env_cache=cache)
    assert [s.env_name for s in specs] == ["rollout_fakes:BoardEnv"] * 6
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
    assert [s.env_name for s in specs] == ["code-env", "code-env"]
    assert specs[0].task.env.class_path.endswith(":CodeEnv")
