"""Tree rollouts (rollout.mode: tree, AT-GRPO): K candidates per turn from one prompt in one request, scored on
forks, one continued; rows, masks, UIDs, the token budget, and the rollouts step over HTTP."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from rollout_fakes import BoardEnv, CharChatTokenizer, ScriptedLLM, ToyAgent, ToyEnv, plan_path_engine_rows

from bench.scripted_server import plan_path_answer
from pettingflow.configs import ConfigError, load_config
from pettingflow.envs.plan_path import PlanPathEnv, parse_moves
from pettingflow.rollout.engine import AgentBinding, ExecutionEngine, group_specs, select_branch
from pettingflow.rollout.records import build_rows
from pettingflow.storage import trajectories_to_table

TOK = CharChatTokenizer()
BOARD = ["S#.G", ".#..", "...."]
K = 3


def by_seed(model, prompt, params):
    """Even sampling seed: the shortest path; odd: a reply without moves (invalid turn, reward -0.5)."""
    return plan_path_answer(prompt, params["seed"])


def tree_run(reply=by_seed, *, layout="per_turn", branches=K, select="best", token_budget=1000, max_turns=6):
    tasks = [{"task_id": "a", "grid": BOARD}, {"task_id": "plan-path/3", "seed": 3}]
    return plan_path_engine_rows(
        reply,
        tokenizer=TOK,
        tasks=tasks,
        layout=layout,
        max_turns=max_turns,
        token_budget=token_budget,
        tree_branches=branches,
        tree_select=select,
    )


def groups(rows):
    out = defaultdict(list)
    for row in rows:
        out[(row["env_idx"], row["turn_idx"], row["agent_idx"])].append(row)
    return out


def test_k_candidates_share_one_prompt_one_request_and_the_best_is_continued() -> None:
    records, stats, rows, llm = tree_run()
    assert len(records) == 2 and all(r.tree and r.id.sample_idx == 0 for r in records)  # one episode per task
    # one request per turn, with n = K
    assert {c["n"] for c in llm.calls} == {K} and len(llm.calls) == stats.turns
    for group in groups(rows).values():
        assert [r["branch_idx"] for r in group] == list(range(K))
        assert len({tuple(r["prompt_ids"]) for r in group}) == 1  # the identical prompt
        assert len({r["uid"] for r in group}) == 1
        continued = [r for r in group if r["continued"]]
        assert len(continued) == 1
        best = max(r["reward"] for r in group)
        assert continued[0]["reward"] == best
        assert continued[0]["branch_idx"] == min(r["branch_idx"] for r in group if r["reward"] == best)
        seeds = [json.loads(r["info_json"])["sampling_seed"] for r in group]
        assert seeds == [seeds[0] + k for k in range(K)]  # vLLM seeds choice k with seed + k
        for row in group:
            assert row["response_mask"] == [1] * len(row["response_ids"]) and row["response_ids"]
            assert len(row["sampler_logprobs"]) == len(row["response_ids"])
            assert row["reward"] == pytest.approx(json.loads(row["info_json"])["turn"]["local_reward"])
    # UIDs: exactly one per (task, turn, agent), K rows each
    assert Counter(Counter(r["uid"] for r in rows).values()) == Counter({K: len(groups(rows))})
    # with K = 3 consecutive seeds at least one candidate is valid: the team walks the shortest path
    assert all(r.done and r.info["team_reward"] == 1.0 for r in records)
    assert stats.per_agent["executor"]["success_rate"] == 1.0
    trajectories_to_table(rows)  # the schema (version 3) accepts them


def test_the_episode_continues_from_the_chosen_candidate_only() -> None:
    def reply(model, prompt, params):  # only branch 1 (seed + 1) answers; the others reply without moves
        return plan_path_answer(prompt, 0) if params["seed"] % K == 1 else "no idea"

    seeds_seen = []

    def recording(model, prompt, params):
        seeds_seen.append(params["seed"])
        return reply(model, prompt, params)

    _, _, rows, llm = tree_run(recording)
    for group in groups(rows).values():
        (kept,) = [r for r in group if r["continued"]]
        assert json.loads(kept["info_json"])["sampling_seed"] % K == 1
    # the executor's prompts show the plan of the continued planner candidate, never "no moves"
    executor_prompts = [c["prompt"] for c in llm.calls if "You are the executor" in c["prompt"]]
    assert executor_prompts and all("The planner's plan: " in p for p in executor_prompts)


def test_candidates_never_touch_the_episode_or_each_other() -> None:
    env = PlanPathEnv({"task_id": "a", "grid": BOARD}, {"max_turns": 6})
    fork = env.fork()
    fork.execute(parse_moves("D D R", 3))
    fork.finish_turn()
    assert fork.state.position == (2, 1) and fork.current_turn == 1
    assert env.state.position == (0, 0) and env.current_turn == 0 and env.state.events == []


def test_per_episode_layout_follows_the_continued_path() -> None:
    records, _, rows, _ = tree_run(layout="per_episode")
    assert len(rows) == sum(len(r.turns) for r in records)  # tree: one row per candidate in both layouts
    for rec in records:
        path = rec.path()
        by_agent = defaultdict(list)
        for t in path:
            by_agent[t.agent_name].append(t)
        for turns in by_agent.values():
            for prev, nxt in itertools.pairwise(turns):
                # the next prompt is the sequence so far: previous prompt + the continued tokens + env tokens
                assert nxt.prompt_ids == prev.prompt_ids + prev.response_ids + prev.env_ids_after
    for row in rows:
        assert row["response_mask"] == [1] * len(row["response_ids"])


def test_token_budget_bounds_the_path_not_the_sum_of_candidates() -> None:
    records, _, _, llm = tree_run(lambda m, p, params: "Moves: R R R R R", token_budget=20, max_turns=8)
    (rec, _) = records
    path_tokens = sum(len(t.response_ids) for t in rec.path())
    assert path_tokens <= 20 < rec.tokens_generated  # all K candidates generated, the path within budget
    assert rec.tokens_generated == sum(len(t.response_ids) for t in rec.turns)
    assert rec.truncated
    # per episode (both alike): the first turn may use 20 tokens, the second what the continued one left
    first = len(rec.path()[0].response_ids)
    assert Counter(c["max_tokens"] for c in llm.calls) == Counter({20: 2, 20 - first: 2})


def test_select_branch_best_ties_and_seeded_sampling() -> None:
    assert select_branch([0.0, 1.0, 1.0, -1.0], "best") == 1
    assert select_branch([0.5], "best") == 0
    draws = [select_branch([0.0, 2.0, 0.0], "sample", random.Random(s)) for s in range(2000)]
    again = [select_branch([0.0, 2.0, 0.0], "sample", random.Random(s)) for s in range(2000)]
    assert draws == again  # seeded: a re-run picks the same branches
    share = draws.count(1) / len(draws)  # softmax: e^2 / (e^2 + 2) = 0.787
    assert share == pytest.approx(0.787, abs=0.03)
    with pytest.raises(ValueError, match="finite"):
        select_branch([float("nan")], "best")
    with pytest.raises(ValueError, match="unknown tree selection"):
        select_branch([1.0], "worst")


def test_sample_selection_is_reproducible_through_the_engine() -> None:
    first = [r["continued"] for r in tree_run(select="sample")[2]]
    assert first == [r["continued"] for r in tree_run(select="sample")[2]]


def test_envs_without_fork_fail_clearly_in_tree_mode() -> None:
    llm = ScriptedLLM(TOK)
    bindings = {"solo": AgentBinding(client=llm, served_model="m", tokenizer=TOK, policy_name="shared")}

    def engine(agent_factory):
        return ExecutionEngine(
            agent_factory, bindings, max_turns=2, token_budget=100, show_progress=False, tree_branches=2
        )

    toy = engine(lambda: [ToyAgent("solo", TOK, "per_turn")])
    with pytest.raises(TypeError, match=r"rollout.mode=tree .* ToyAgent has no fork"):
        asyncio.run(toy.run(group_specs(["T"], 1, 0, "toy", lambda s: ToyEnv(s.task))))
    board = BoardEnv({"task_id": "b"})
    with pytest.raises(NotImplementedError, match=r"BoardEnv cannot fork .* rollout.mode=independent"):
        board.fork()
    with pytest.raises(ValueError, match="tree_branches must be >= 1"):
        ExecutionEngine(lambda: [], bindings, max_turns=1, token_budget=1, tree_branches=0)


def test_tree_branches_is_its_own_setting_and_group_size_keeps_its_meaning() -> None:
    """``rollout.tree.branches`` is K, the candidates per turn; ``env.group_size`` stays the episodes per task in
    every mode (1 in tree mode), and the group GRPO compares is K rows in tree mode, G otherwise."""
    config = load_config("plan-path", ["rollout.mode=tree", "rollout.tree.branches=3", "env.group_size=1"])
    assert (config.rollout.tree.branches, config.env.group_size, config.advantage_group_size) == (3, 1, 3)
    independent = load_config("plan-path", ["env.group_size=5"])
    assert independent.rollout.tree.branches is None and independent.advantage_group_size == 5
    for name in ("plan-path-learn-tree", "plan-path-learn-lookahead", "code-env-learn-tree"):
        shipped = load_config(name)
        assert (shipped.rollout.mode, shipped.rollout.tree.branches, shipped.env.group_size) == ("tree", 4, 1), name


def test_the_earlier_tree_spelling_fails_and_names_the_new_one() -> None:
    """Tree mode used to read ``env.group_size`` as the candidates per turn (and run one episode per task). Such a
    config must not now run something else under the same words: it fails, saying what to write for the same
    rollouts. Tree settings outside tree mode and a tree group of one fail too."""
    with pytest.raises(ConfigError) as old:
        load_config("plan-path", ["rollout.mode=tree", "env.group_size=8"])
    assert [path for path, _ in old.value.problems] == ["rollout.tree.branches"]
    assert "now says rollout.tree.branches: 8 and env.group_size: 1 (the same rollouts)" in str(old.value)
    with pytest.raises(ConfigError, match=r"runs one episode per task.*set env.group_size=1 \(got 4\)"):
        load_config("plan-path", ["rollout.mode=tree", "rollout.tree.branches=4"])
    with pytest.raises(ConfigError, match=r"rollout.tree.branches=4 is the candidates per turn of tree mode, but "):
        load_config("plan-path", ["rollout.tree.branches=4"])
    one = ["rollout.mode=tree", "rollout.tree.branches=1", "env.group_size=1", "algorithm.filter_method=none"]
    with pytest.raises(ConfigError) as single:
        load_config("plan-path", one)
    assert single.value.problems == [
        (
            "rollout.tree.branches",
            "grpo advantages are relative to the other samples of a group; with rollout.tree.branches=1 every "
            "advantage is 0 and nothing is learned (use >= 2)",
        )
    ]


def test_a_tree_run_stored_in_the_earlier_spelling_still_loads_with_the_same_rollouts(tmp_path) -> None:
    """A run started before ``rollout.tree.branches`` stored K as ``env.group_size`` in its run.json: that run still
    resumes, re-runs, summarizes and exports (its config read as branches K, one episode per task); the same
    mapping written by a user still fails (the test above)."""
    from pettingflow.configs.loader import upgrade_stored_config, validate_stored_config
    from pettingflow.runs.run import RunRef, load_run_config
    from pettingflow.storage import RunLayout

    new = load_config("plan-path", ["rollout.mode=tree", "rollout.tree.branches=4", "env.group_size=1"])
    stored = new.model_dump(mode="json")
    stored["rollout"]["tree"].pop("branches")
    stored["env"]["group_size"] = 4  # as a run of Nov 27 wrote it
    upgraded = validate_stored_config(stored, source="run.json")
    assert (upgraded.rollout.tree.branches, upgraded.env.group_size) == (4, 1)
    assert upgraded.model_dump(mode="json") == new.model_dump(mode="json")
    assert stored["env"]["group_size"] == 4 and "branches" not in stored["rollout"]["tree"]  # the input is untouched
    independent = load_config("plan-path", ["env.group_size=5"]).model_dump(mode="json")
    assert upgrade_stored_config(independent) == independent  # nothing else is rewritten
    layout = RunLayout(str(tmp_path), "old-tree-run")
    layout.fs.makedirs(layout.run_path, exist_ok=True)
    Path(layout.run_path, "run.json").write_text(json.dumps({"run_id": "old-tree-run", "config": stored}))
    ref = RunRef(root=str(tmp_path), run_id="old-tree-run")
    assert load_run_config(ref).rollout.tree.branches == 4


def test_build_rows_takes_the_episodes_per_task_not_the_branches() -> None:
    """Tree records were run one episode per task: ``group_size`` K (the old call) is refused, not rewritten."""
    records, _, rows, _ = tree_run()
    assert {len(g) for g in groups(rows).values()} == {K}
    with pytest.raises(ValueError, match=r"group_size=3; tree mode runs one episode per task, so pass group_size=1"):
        build_rows(records, "per_turn", "run", 0, group_size=K)


def test_collect_step_in_tree_mode_against_the_scripted_server(tmp_path, default_model_dir, default_tokenizer) -> None:
    """The rollouts step over HTTP in tree mode: one request with n = G per turn, one shard per task."""
    from bench.scripted_server import ScriptedServer
    from pettingflow.runs.context import IterationContext
    from pettingflow.runs.endpoint import PolicyEndpoint
    from pettingflow.steps.rollouts import collect_step
    from pettingflow.storage import RunLayout, read_step_trajectories

    config = load_config(
        "plan-path",
        [
            f"run.storage_root={tmp_path}",
            "env.max_turns=6",
            "env.token_budget=200",
            "rollout.mode=tree",
            "env.group_size=1",
            "rollout.tree.branches=3",
        ],
    )
    layout = RunLayout(str(tmp_path), "run-tree")
    with ScriptedServer(default_tokenizer, {}) as server:
        endpoint = PolicyEndpoint("shared", server.url, "shared", str(default_model_dir))
        outcome = collect_step(IterationContext(layout, 0), config, {"shared": endpoint}, show_progress=False)
        requests = list(server.requests)
    g = config.rollout.tree.branches
    rows = read_step_trajectories(layout.step(0, "rollouts")).to_pylist()
    assert outcome.rows == len(rows) and outcome.metrics["mode"] == "tree"
    assert outcome.metrics["episodes"] == config.env.tasks_per_iteration  # one episode per task
    assert outcome.metrics["samples_per_task"] == 1
    assert {r["n"] for r in requests} == {g} and len(rows) == g * len(requests)
    assert {r["sample_idx"] for r in rows} == {0}
    for group in groups(rows).values():
        assert len(group) == g and len({tuple(r["prompt_ids"]) for r in group}) == 1
        assert len({r["uid"] for r in group}) == 1 and sorted(r["branch_idx"] for r in group) == list(range(g))
        (kept,) = [r for r in group if r["continued"]]
        assert kept["reward"] == max(r["reward"] for r in group)
        for row in group:
            assert row["response_mask"] == [1] * len(row["response_ids"])
            assert default_tokenizer.decode(row["prompt_ids"]).rstrip().endswith("assistant")
