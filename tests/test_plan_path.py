"""The plan-path env (docs/plan-path.md): generation, knobs, the split, the rules (property-tested),
per-turn and team rewards, and two-agent episodes through the real rollout engine."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_fakes import CharChatTokenizer, plan_path_engine_rows

from bench.scripted_server import plan_path_answer
from pettingflow.agents import resolve_agent_class
from pettingflow.agents.plan_agents import ExecutorAgent, PlannerAgent
from pettingflow.configs import load_config
from pettingflow.configs.settings import DatasetSettings
from pettingflow.envs import EnvConfigError, load_tasks, resolve_env_class
from pettingflow.envs.plan_path import (
    MOVES,
    Grid,
    ParsedMoves,
    PlanPathConfig,
    PlanPathEnv,
    generate_grid,
    load_plan_path_tasks,
    parse_moves,
    potential_shaping,
    shaped_move_reward,
    walk,
)

TOK = CharChatTokenizer()
KNOBS = [
    {},
    {"rows": 5, "cols": 5},
    {"rows": 6, "cols": 3, "wall_density": 0.3, "min_path_len": 4, "max_path_len": None},
    {"rows": 2, "cols": 2, "wall_density": 0.0, "min_path_len": 1, "max_path_len": 1},
    {"rows": 8, "cols": 8, "wall_density": 0.35, "min_path_len": 6, "max_path_len": 10},
]
# the board of the plan-path-learn* configs (docs/plan-path.md, "Sizes for SmolLM2-135M")
LEARN_BOARD = {"rows": 5, "cols": 5, "wall_density": 0.2, "min_path_len": 1, "max_path_len": 6, "max_moves_per_turn": 4}
# a hand-made board: S at (0, 0), G at (0, 3), a wall column at 1 with a gap in row 2
BOARD = ["S#.G", ".#..", "...."]


def run(coro):
    return asyncio.run(coro)


def env_of(grid_rows=BOARD, **config) -> PlanPathEnv:
    return PlanPathEnv({"task_id": "t", "grid": list(grid_rows)}, {"max_turns": 6, **config})


# --------------------------------------------------------------------------------------------------
# generation and knobs
# --------------------------------------------------------------------------------------------------
def test_generation_is_deterministic_per_seed_and_pinned() -> None:
    config = PlanPathConfig()
    assert [generate_grid(s, config) for s in range(30)] == [generate_grid(s, config) for s in range(30)]
    assert len({tuple(generate_grid(s, config).to_rows()) for s in range(30)}) > 25  # seeds differ
    # pinned: the same grid on every machine and Python version (string-seeded random.Random)
    assert generate_grid(3, config).to_rows() == ["..G.", "..#S", "..#.", "...#"]


@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "defaults")
def test_every_generated_grid_respects_the_knobs_and_is_solvable(knobs) -> None:
    config = PlanPathConfig(**knobs)
    n_walls = round(config.wall_density * config.rows * config.cols)
    high = config.max_path_len or config.rows * config.cols
    lengths = Counter()
    for seed in range(150):
        grid = generate_grid(seed, config)
        assert (grid.rows, grid.cols) == (config.rows, config.cols)
        assert len(grid.walls) == n_walls
        assert grid.free(grid.start) and grid.free(grid.goal) and grid.start != grid.goal
        path = grid.shortest_path()
        assert path is not None, grid.to_rows()
        assert config.min_path_len <= len(path) <= high
        assert walk(grid, grid.start, path).reached_goal  # the BFS path really walks there
        assert Grid.from_rows(grid.to_rows()) == grid
        lengths[len(path)] += 1
    if config.max_path_len and config.max_path_len > config.min_path_len:
        assert len(lengths) > 1  # the whole allowed range is used, not only one length


def test_infeasible_knobs_are_config_errors_naming_the_knob() -> None:
    with pytest.raises(EnvConfigError, match="max_path_len=2 is below min_path_len=3"):
        PlanPathEnv.validate_config({"min_path_len": 3, "max_path_len": 2})
    with pytest.raises(EnvConfigError, match="min_path_len=20 cannot fit"):
        PlanPathEnv.validate_config({"rows": 3, "cols": 3, "min_path_len": 20, "max_path_len": None})
    with pytest.raises(EnvConfigError, match="wall_density"):
        PlanPathEnv.validate_config({"wall_density": 0.7})
    with pytest.raises(EnvConfigError, match="wall_densty"):
        PlanPathEnv.validate_config({"wall_densty": 0.1})


def test_generation_that_cannot_succeed_says_which_knobs_to_relax() -> None:
    # passes the config check (4 free cells could hold a 3-move path) but no 2x2 grid has one: BFS gives <= 2
    config = PlanPathConfig(rows=2, cols=2, wall_density=0.0, min_path_len=3, max_path_len=None)
    with pytest.raises(ValueError, match=r"no solvable grid for seed 5 .* lower wall_density or min_path_len"):
        generate_grid(5, config)


def test_bad_explicit_grids_are_refused() -> None:
    with pytest.raises(ValueError, match="exactly one 'S' and one 'G'"):
        env_of(["S..", "..."])
    with pytest.raises(ValueError, match="equally long"):
        env_of(["S..", "..G."])
    with pytest.raises(ValueError, match="cannot be reached"):
        env_of(["S#G"])
    with pytest.raises(ValueError, match="needs a 'seed' or a 'grid'"):
        PlanPathEnv({"task_id": "x"})


def test_split_holds_out_tasks_from_disjoint_seeds() -> None:
    split = load_tasks(DatasetSettings(source="plan-path", num_tasks=50, validation_fraction=0.2))
    train = {t["seed"] for t in split.train}
    held = {t["seed"] for t in split.validation}
    assert len(held) == 10 and len(train) == 40 and not train & held and train | held == set(range(50))
    again = load_tasks(DatasetSettings(source="plan-path", num_tasks=50, validation_fraction=0.2))
    assert again == split
    assert load_plan_path_tasks(3) == [{"task_id": f"plan-path/{s}", "seed": s} for s in range(3)]
    with pytest.raises(ValueError, match="at least 2 tasks"):
        load_plan_path_tasks(1)


def test_registered_names_and_config_file() -> None:
    assert resolve_env_class("plan-path") is PlanPathEnv
    assert resolve_agent_class("plan-path-planner") is PlannerAgent
    assert resolve_agent_class("plan-path-executor") is ExecutorAgent
    config = load_config("plan-path")
    assert [a.class_path for a in config.agents] == ["plan-path-planner", "plan-path-executor"]
    assert config.env.group_size == 4 and config.env.dataset.source == "plan-path"
    PlanPathEnv.validate_config({"max_turns": config.env.max_turns, **config.env.options})


def test_prefect_deployment_train_plan_path() -> None:
    import yaml

    from pettingflow.configs.loader import CONFIG_DIR

    deployments = yaml.safe_load((CONFIG_DIR.parent / "prefect.yaml").read_text())["deployments"]
    by_flow = {d["entrypoint"]: d for d in deployments if d["name"] == "plan-path"}
    assert set(by_flow) == {"flows/train.py:train", "flows/learn.py:learn"}
    assert by_flow["flows/train.py:train"]["parameters"]["config"] == "plan-path"
    learn = by_flow["flows/learn.py:learn"]["parameters"]  # the AT-GRPO evidence of docs/results.md
    # the study's arms (the list grows with new arms): the three plan-path-learn* configs at least, all loadable
    assert {"plan-path-learn-tree", "plan-path-learn", "plan-path-learn-solo"} <= set(learn["configs"])
    assert all(load_config(name).env.class_path == "plan-path" for name in learn["configs"])
    assert len(learn["seeds"]) >= 2


# --------------------------------------------------------------------------------------------------
# parsing
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "moves", "ignored"),
    [
        ("Plan: R R D", ("R", "R", "D"), 0),
        ("Moves: right, down", ("R", "D"), 0),
        ("I would go RRD then U", ("R", "R", "D"), 1),
        ("Let me think.\nMoves: U\nActually Moves: D D", ("U",), 0),
        ("Plan: (none)\nGo Left and then UP", ("L", "U"), 0),
        ("no idea", (), 0),
        ("RULE: upward is ok", (), 0),  # "RULE" and "upward" are not moves
        ("", (), 0),
    ],
)
def test_parse_moves(text, moves, ignored) -> None:
    assert parse_moves(text, 3) == ParsedMoves(moves, ignored)


# --------------------------------------------------------------------------------------------------
# the rules, property-tested
# --------------------------------------------------------------------------------------------------
grids = st.builds(
    generate_grid,
    st.integers(0, 10_000),
    st.sampled_from([PlanPathConfig(**k) for k in KNOBS]),
)
move_lists = st.lists(st.sampled_from(sorted(MOVES)), max_size=8)
no_move_text = st.text(alphabet="abcefghijkmnopqstvwxyz .,!?:0123456789\n", max_size=40)


@settings(max_examples=300, deadline=None)
@given(grid=grids, moves=move_lists)
def test_illegal_moves_leave_the_position_and_stop_the_walk(grid: Grid, moves: list[str]) -> None:
    w = walk(grid, grid.start, moves)
    here = grid.start
    for i, step in enumerate(w.steps):
        dr, dc = MOVES[step.move]
        target = (here[0] + dr, here[1] + dc)
        assert step.move == moves[i]
        if not grid.inside(target):
            assert step.outcome == "out_of_bounds" and step.position == here
        elif target in grid.walls:
            assert step.outcome == "wall" and step.position == here
        else:
            assert step.outcome == "moved" and step.position == target
            here = target
        if step.outcome != "moved":
            assert i == len(w.steps) - 1  # nothing after an illegal move is tried
    assert w.end == here and grid.free(here)
    assert w.not_tried == len(moves) - len(w.steps)
    assert w.reached_goal == (here == grid.goal)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), script=st.lists(st.one_of(move_lists, no_move_text), min_size=1, max_size=8))
def test_an_episode_follows_the_rules(seed: int, script: list) -> None:
    """Planner and executor alternate with random replies (move lists or text without moves). Checks:
    illegal and unparseable turns leave the position and are reported to both agents; the goal ends
    the episode with team reward 1; the turn budget ends it with 0; progress sums to the distance decrease."""
    env = PlanPathEnv({"task_id": "p", "seed": seed}, {"max_turns": 6})
    planner, executor = PlannerAgent(tokenizer=TOK), ExecutorAgent(tokenizer=TOK, agent_idx=1)
    d0 = env.state.start_distance
    progresses = []
    turn = 0
    while not env.done:
        agent = (planner, executor)[turn % 2]
        agent.update_from_env(turn, env)
        reply = script[turn % len(script)]
        text = " ".join(reply) if isinstance(reply, list) else reply
        before = env.state.position
        action = agent.update_from_model(turn, env, text)
        run(agent.step(env))
        info = agent.turn_info
        progresses.append(info["progress"])
        assert info["distance_after"] == env.distance(env.state.position)
        if agent is planner or not action.valid:
            assert env.state.position == before  # only the executor's valid moves move anything
        if not action.valid:
            assert info["invalid"] and agent.agent_reward == info["progress"] - 0.5 == -0.5
            if not env.done:  # the other agent is told on its next turn
                assert "had no moves" in (planner, executor)[(turn + 1) % 2].turn_prompt(env)
        elif agent is executor:
            w = env.state.last_walk
            assert w.end == env.state.position
            assert [s.outcome for s in w.steps] == info["outcomes"]
            if not env.done:
                shown = planner.turn_prompt(env)
                for outcome, phrase in (("wall", "blocked by a wall"), ("out_of_bounds", "would leave the board")):
                    assert (outcome in info["outcomes"]) == (phrase in shown)
        turn += 1
    reached = env.state.position == env.state.grid.goal
    info = env.episode_info()
    assert info["team_reward"] == (1.0 if reached else 0.0) and info["goal_reached"] == reached
    assert env.truncated == (not reached)
    if reached:
        assert executor.success and turn % 2 == 0  # the goal is reached on an executor turn and ends the episode
    else:
        assert turn == env.max_turns
    assert sum(progresses) == pytest.approx((d0 - env.state.distance) / d0)


def test_goal_ends_the_episode_early_with_team_reward_one() -> None:
    env = env_of()  # shortest path: D D R R U U R (7 moves)
    planner, executor = PlannerAgent(tokenizer=TOK), ExecutorAgent(tokenizer=TOK, agent_idx=1)
    rewards = []
    for turn, text in enumerate(["Plan: D D R", "Moves: D D R", "Plan: R U U", "Moves: R U U", "Plan: R", "R"]):
        agent = (planner, executor)[turn % 2]
        agent.update_from_env(turn, env)
        agent.update_from_model(turn, env, text)
        run(agent.step(env))
        rewards.append((agent.agent_reward, agent.success))
    assert env.done and not env.truncated and env.current_turn == 6
    # plan rewards = the progress the plan would make; executor rewards = progress made; d0 = 7
    assert rewards == [(3 / 7, False), (3 / 7, False), (3 / 7, False), (3 / 7, False), (1 / 7, True), (1 / 7, True)]
    assert env.episode_info()["team_reward"] == 1.0


def test_turn_budget_ends_the_episode_with_team_reward_zero() -> None:
    env = env_of(max_turns=4)
    agents = [PlannerAgent(tokenizer=TOK), ExecutorAgent(tokenizer=TOK, agent_idx=1)]
    for turn, text in enumerate(["Plan: D", "Moves: R", "Plan: D", "Moves: U"]):  # into a wall, off the board
        agents[turn % 2].update_from_env(turn, env)
        agents[turn % 2].update_from_model(turn, env, text)
        run(agents[turn % 2].step(env))
    assert env.done and env.truncated
    assert env.episode_info() == {
        "team_reward": 0.0,
        "goal_reached": False,
        "start_distance": 7,
        "final_distance": 7,
        "grid": BOARD,
    }
    assert [e["outcomes"] for e in env.state.events] == [["moved"], ["wall"], ["moved"], ["out_of_bounds"]]
    assert [e["local_reward"] for e in env.state.events] == [1 / 7, 0.0, 1 / 7, 0.0]


def test_prompts_show_board_plan_and_what_happened() -> None:
    env = env_of()
    planner, executor = PlannerAgent(tokenizer=TOK), ExecutorAgent(tokenizer=TOK, agent_idx=1)
    first = planner.update_from_env(0, env).messages
    assert first[0]["role"] == "system" and "planner" in first[0]["content"]
    assert "A # . G\n. # . .\n. . . ." in first[1]["content"]
    assert "It is 3 columns right from you." in first[1]["content"]
    planner.update_from_model(0, env, "Plan: R R")
    run(planner.step(env))
    text = executor.update_from_env(1, env).messages[-1]["content"]
    assert "The planner's plan: R R" in text
    executor.update_from_model(1, env, "Moves: D R")
    run(executor.step(env))
    text = planner.update_from_env(2, env).messages[-1]["content"]
    assert "D moved to row 1, column 0; R was blocked by a wall (stayed at row 1, column 0)." in text
    assert "You are at row 1, column 0." in text and "Turns left for the team: 4." in text
    assert "It is" not in PlannerAgent(tokenizer=TOK).turn_prompt(env_of(show_offset=False))


def test_answer_prefix_starts_the_reply_in_the_prompt_and_is_parsed_with_it() -> None:
    """answer_prefix: the prompt ends with 'Plan:' / 'Moves:' after the assistant header; the model's continuation
    ' R R' is parsed as 'Plan: R R'; off, prompts are unchanged; the per_episode layout refuses it."""
    env = env_of(answer_prefix=True)
    planner, executor = PlannerAgent(tokenizer=TOK), ExecutorAgent(tokenizer=TOK, agent_idx=1)
    prompt = planner.update_from_env(0, env)
    assert TOK.decode(prompt.token_ids).endswith("<assistant>Plan:")
    assert prompt.token_ids == PlannerAgent(tokenizer=TOK).update_from_env(0, env_of()).token_ids + TOK.encode("Plan:")
    assert planner.update_from_model(0, env, " R R").moves == ("R", "R")
    run(planner.step(env))
    assert TOK.decode(executor.update_from_env(1, env).token_ids).endswith("<assistant>Moves:")
    with pytest.raises(ValueError, match="per_turn"):
        PlannerAgent(tokenizer=TOK, layout="per_episode").update_from_env(0, env_of(answer_prefix=True))


# --------------------------------------------------------------------------------------------------
# through the real rollout engine
# --------------------------------------------------------------------------------------------------
def engine_rows(reply, *, layout: str = "per_turn", tasks=None, group_size: int = 2, overrides=()):
    tasks = tasks or [{"task_id": "a", "grid": BOARD}, {"task_id": "plan-path/3", "seed": 3}]
    return plan_path_engine_rows(
        reply, tokenizer=TOK, tasks=tasks, layout=layout, group_size=group_size, overrides=tuple(overrides)
    )


def test_the_prefill_is_stored_apart_from_the_model_text_and_shown_with_it() -> None:
    """With answer_prefix, each row keeps the prefill ('Plan:' / 'Moves:') in its own column, the model's text in
    response_text (what its tokens decode to), and the reply as the agent parsed it is the two joined: the
    scripted team (which continues the prefill) solves, and the printout shows the prefill marked."""
    from pettingflow.analysis.inspect import reply_text

    def continue_prefill(model, prompt, params):
        answer = plan_path_answer(prompt, 0)
        label = "Plan:" if answer.startswith("Plan:") else "Moves:"
        assert prompt.endswith(label)  # the prompt holds the prefill; the model writes what follows
        return answer[len(label) :]

    records, _, rows, _ = engine_rows(continue_prefill, overrides=["env.options.answer_prefix=true"])
    assert all(r.outcome == "solved" for r in records)
    assert {r["agent_name"]: r["prefill"] for r in rows} == {"planner": "Plan:", "executor": "Moves:"}
    for row in rows:
        # the model's tokens (and its end-of-text) decode to response_text, without the prefill
        assert TOK.decode(row["response_ids"]).startswith(row["response_text"]) and row["response_text"][:1] == " "
        assert TOK.decode(row["prompt_ids"]).endswith(row["prefill"])  # its tokens: the prompt's last ones
        assert reply_text(row) == f"⟦{row['prefill']}⟧{row['response_text']}"
    _, _, plain, _ = engine_rows(lambda model, prompt, params: plan_path_answer(prompt, 0))
    assert {r["prefill"] for r in plain} == {""} and reply_text(plain[0]) == plain[0]["response_text"]


def test_scripted_team_solves_through_the_engine_with_rows_like_the_code_env() -> None:
    records, stats, rows, llm = engine_rows(lambda model, prompt, params: plan_path_answer(prompt, 0))
    assert all(r.done and not r.truncated for r in records)
    assert stats.per_agent["executor"]["success_rate"] == 1.0
    assert {r["agent_name"] for r in rows} == {"planner", "executor"}
    for row in rows:
        assert row["response_mask"] == [1] * len(row["response_ids"]) and row["response_ids"]
        assert len(row["sampler_logprobs"]) == len(row["response_ids"])
        info = json.loads(row["info_json"])
        assert info["team_reward"] == 1.0 and info["turn"]["role"] == row["agent_name"]
        assert row["reward"] == pytest.approx(info["turn"]["local_reward"])
    # UIDs: one per (task, turn, agent), shared by the G samples of a task, as in the code env
    by_uid: dict[str, set] = {}
    for row in rows:
        by_uid.setdefault(row["uid"], set()).add((row["env_idx"], row["turn_idx"], row["agent_idx"]))
    assert all(len(keys) == 1 for keys in by_uid.values())
    assert Counter(r["uid"] for r in rows) == Counter({u: 2 for u in by_uid})
    # the progress of every episode adds up to 1 (the whole distance), on the executor's rows
    for rec in records:
        ep_rows = [r for r in rows if r["rollout_idx"] == rec.id.rollout_idx]
        assert sum(json.loads(r["info_json"])["turn"]["progress"] for r in ep_rows) == pytest.approx(1.0)
    # the agents only talked through the env: the executor's prompt shows the planner's plan
    executor_prompts = [c["prompt"] for c in llm.calls if "You are the executor" in c["prompt"]]
    assert executor_prompts and all("The planner's plan: " in p for p in executor_prompts)


def test_a_team_that_never_moves_runs_out_of_turns_with_team_reward_zero() -> None:
    records, stats, rows, _ = engine_rows(lambda model, prompt, params: "hmm", layout="per_episode")
    assert all(r.truncated and len(r.turns) == 6 for r in records)
    assert stats.per_agent["planner"]["success_rate"] == stats.per_agent["executor"]["success_rate"] == 0.0
    assert len(rows) == 2 * len(records)  # per_episode: one row per agent per episode
    for row in rows:
        info = json.loads(row["info_json"])
        assert info["team_reward"] == 0.0 and [t["invalid"] for t in info["turn_infos"]] == [True] * 3
        assert row["reward"] == -0.5
        assert 0 in row["response_mask"] and row["response_mask"][0] == row["response_mask"][-1] == 1


def test_collect_step_against_the_scripted_server(tmp_path, default_model_dir, default_tokenizer) -> None:
    """The rollouts step over HTTP: real tokenizer and inference client, committed Parquet rows."""
    from bench.scripted_server import ScriptedServer
    from pettingflow.runs.context import IterationContext
    from pettingflow.runs.endpoint import PolicyEndpoint
    from pettingflow.steps.rollouts import collect_step
    from pettingflow.storage import RunLayout, read_step_trajectories

    config = load_config("plan-path", [f"run.storage_root={tmp_path}", "env.max_turns=6", "env.token_budget=200"])
    layout = RunLayout(str(tmp_path), "run-plan-path")
    with ScriptedServer(default_tokenizer, {}) as server:
        endpoint = PolicyEndpoint("shared", server.url, "shared", str(default_model_dir))
        outcome = collect_step(IterationContext(layout, 0), config, {"shared": endpoint}, show_progress=False)
    rows = read_step_trajectories(layout.step(0, "rollouts")).to_pylist()
    assert outcome.rows == len(rows) and {r["agent_name"] for r in rows} == {"planner", "executor"}
    infos = [json.loads(r["info_json"]) for r in rows]
    # even sampling seeds answer the shortest path, odd ones a reply without moves: both kinds occur
    assert {i["turn"]["invalid"] for i in infos} == {True, False}
    for row, info in zip(rows, infos, strict=True):
        assert row["response_mask"] == [1] * len(row["response_ids"])
        assert default_tokenizer.decode(row["prompt_ids"]).rstrip().endswith("assistant")
        assert row["reward"] == pytest.approx(info["turn"]["local_reward"], abs=1e-6)
        assert info["team_reward"] == (1.0 if info["goal_reached"] else 0.0)
    assert all(t.startswith("plan-path/") for t in outcome.metrics["tasks"])


def test_solo_walker_moves_alone_with_the_executor_rules() -> None:
    """The single-agent baseline: every turn is a moving turn, scored like the executor's, and its
    prompt has the board and answer format but no partner."""
    from pettingflow.agents.plan_agents import WalkerAgent

    assert resolve_agent_class("plan-path-walker") is WalkerAgent
    env = env_of(max_turns=3)
    walker = WalkerAgent(tokenizer=TOK)
    rewards = []
    for turn, text in enumerate(["Moves: D D R", "I do not know", "R U U"]):
        messages = walker.update_from_env(turn, env).messages
        if turn == 0:
            assert "planner" not in messages[0]["content"] and "partner" not in messages[0]["content"]
            assert "A # . G" in messages[1]["content"] and "Turns left for you: 3." in messages[1]["content"]
        walker.update_from_model(turn, env, text)
        run(walker.step(env))
        rewards.append(walker.agent_reward)
        if turn == 0:
            assert "Last turn you moved: D moved to row 1, column 0" in walker.turn_prompt(env)
        if turn == 1:
            assert "Last turn your reply had no moves" in walker.turn_prompt(env)
    assert rewards == [3 / 7, -0.5, 3 / 7]
    assert env.done and env.truncated and env.episode_info()["final_distance"] == 1


# --------------------------------------------------------------------------------------------------
# the shaped reward (the reference's dense per-move reward), the team outcome, forks
# --------------------------------------------------------------------------------------------------
def shaped_env(**config) -> PlanPathEnv:
    return env_of(reward="shaped", **config)


def test_shaped_reward_arithmetic_on_the_hand_made_board() -> None:
    """BFS distances on BOARD: (0,0) 7, (1,0) 6, (2,0) 5, (2,1) 4, (2,2) 3, (1,2) 2, (0,2) 1, (0,3) 0.
    A made move from d to d - 1 earns -0.01 + (d - 0.99 (d - 1)) = 0.98 + 0.01 d; a blocked one at d earns
    -0.1 + 0.01 d; the goal adds 1, the optimal path 0.5."""
    config = PlanPathConfig(reward="shaped")
    assert potential_shaping(7, 6, 0.99, 1.0) == pytest.approx(1.06)
    assert potential_shaping(7, 7, 0.99, 1.0) == pytest.approx(0.07)  # a blocked move: (1 - gamma) d
    assert potential_shaping(3, 4, 1.0, 2.0) == pytest.approx(-2.0)  # walking away, lambda 2, no discount
    assert shaped_move_reward(True, 7, 6, reached_goal=False, optimal=False, config=config) == pytest.approx(1.05)
    assert shaped_move_reward(False, 7, 7, reached_goal=False, optimal=False, config=config) == pytest.approx(-0.03)
    assert shaped_move_reward(True, 1, 0, reached_goal=True, optimal=False, config=config) == pytest.approx(1.99)
    assert shaped_move_reward(True, 1, 0, reached_goal=True, optimal=True, config=config) == pytest.approx(2.49)

    env = shaped_env(max_moves_per_turn=7)
    out = env.execute(parse_moves("Moves: D D R", 7))  # step cost + shaping, three moves
    assert out.info["move_rewards"] == pytest.approx([1.05, 1.04, 1.03])
    assert out.reward == out.info["local_reward"] == out.info["shaped_reward"] == pytest.approx(3.12)
    assert env.team_outcome() == pytest.approx(3.12)

    env = shaped_env(max_moves_per_turn=7)  # the whole shortest path in one reply: goal + optimal bonus
    out = env.execute(parse_moves("D D R R U U R", 7))
    # shaping telescopes: sum(d_i) - 0.99 sum(d_{i+1}) = 28 - 20.79; 7 step costs; goal 1; optimal 0.5
    assert out.reward == pytest.approx(28 - 20.79 - 0.07 + 1.0 + 0.5) == pytest.approx(8.64)
    assert out.success and env.team_outcome() == pytest.approx(8.64)

    env = shaped_env(max_moves_per_turn=7)  # a blocked move first: the same path later is not optimal any more
    blocked = env.execute(parse_moves("R D", 7))  # R into the wall ends the walk; D is not tried
    assert blocked.info["outcomes"] == ["wall"] and blocked.reward == pytest.approx(-0.03)
    out = env.execute(parse_moves("D D R R U U R", 7))
    assert out.reward == pytest.approx(8.64 - 0.5)  # goal, no optimal bonus (8 moves tried for a 7-move path)
    assert env.team_outcome() == pytest.approx(8.64 - 0.5 - 0.03)

    env = shaped_env()  # a reply without moves: the turn's penalty, nothing for the team
    out = env.execute(parse_moves("no idea", 3))
    assert out.reward == pytest.approx(-0.5) and out.info["shaped_reward"] == 0.0 and env.team_outcome() == 0.0

    env = shaped_env(step_cost=0.0, blocked_move_cost=1.0, shaping_gamma=1.0, shaping_lambda=0.5, goal_reward=2.0)
    assert env.execute(parse_moves("R", 3)).reward == pytest.approx(-1.0)  # gamma 1: a blocked move shapes 0
    assert env.execute(parse_moves("D", 3)).reward == pytest.approx(0.5)  # lambda * (7 - 6)


def test_shaped_planner_reward_is_the_simulated_walk_and_moves_nothing() -> None:
    env = shaped_env()
    planner, executor = PlannerAgent(tokenizer=TOK), ExecutorAgent(tokenizer=TOK, agent_idx=1)
    rewards = []
    script = ["Plan: D D R", "Moves: D D R", "Plan: R U U", "Moves: R U U", "Plan: R", "R"]
    for turn, text in enumerate(script):
        agent = (planner, executor)[turn % 2]
        agent.update_from_env(turn, env)
        agent.update_from_model(turn, env, text)
        run(agent.step(env))
        rewards.append(agent.agent_reward)
        if agent is planner:  # the plan's shaped reward is not the team's
            assert env.team_outcome() == pytest.approx(sum(rewards[1::2]))
    # plan and execution of the same moves earn the same; the last move reaches the goal on the optimal path
    assert rewards == pytest.approx([3.12, 3.12, 3.03, 3.03, 2.49, 2.49])
    assert env.done and not env.truncated
    assert env.team_outcome() == env.episode_info()["team_reward"] == pytest.approx(8.64)
    assert [e["progress"] for e in env.state.events] == pytest.approx([0, 3 / 7, 0, 3 / 7, 0, 1 / 7])  # actual moves


def test_progress_mode_is_unchanged_and_its_team_outcome_is_goal_reached() -> None:
    env = env_of()
    assert PlanPathConfig().reward == "progress" and env.team_outcome() == 0.0
    out = env.execute(parse_moves("D D R", 3))
    assert out.reward == pytest.approx(3 / 7) and "shaped_reward" not in out.info and env.team_outcome() == 0.0
    env.execute(parse_moves("R U U", 3))
    env.execute(parse_moves("R", 3))
    assert env.solved() and env.team_outcome() == env.episode_info()["team_reward"] == 1.0


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(["progress", "shaped"]),
    script=st.lists(st.one_of(move_lists, no_move_text), min_size=1, max_size=8),
)
def test_team_outcome_is_the_episode_team_reward_at_the_end(seed: int, mode: str, script: list) -> None:
    """Random replies in both modes: at the end ``team_outcome()`` equals ``episode_info()["team_reward"]``;
    in shaped mode it is the sum of the executor's move rewards, and every turn's local reward is its moves'
    shaped reward minus the penalty of a reply without moves."""
    env = PlanPathEnv({"task_id": "p", "seed": seed}, {"max_turns": 6, "reward": mode, **LEARN_BOARD})
    agents = (PlannerAgent(tokenizer=TOK), ExecutorAgent(tokenizer=TOK, agent_idx=1))
    executed = 0.0
    turn = 0
    while not env.done:
        agent = agents[turn % 2]
        agent.update_from_env(turn, env)
        reply = script[turn % len(script)]
        action = agent.update_from_model(turn, env, " ".join(reply) if isinstance(reply, list) else reply)
        run(agent.step(env))
        info = agent.turn_info
        if mode == "shaped":
            penalty = 0.0 if action.valid else 0.5
            assert info["local_reward"] == pytest.approx(sum(info["move_rewards"]) - penalty)
            if agent is agents[1]:
                executed += info["shaped_reward"]
            assert env.team_outcome() == pytest.approx(executed)
        turn += 1
    assert env.team_outcome() == env.episode_info()["team_reward"]
    if mode == "progress":
        assert env.team_outcome() == (1.0 if env.solved() else 0.0)


def test_forks_are_independent_in_shaped_mode() -> None:
    env = shaped_env()
    env.execute(parse_moves("D D", 3))
    env.finish_turn()
    before = (env.state.position, env.state.moves_tried, env.team_outcome(), len(env.state.events))
    twin = env.fork()
    out = twin.execute(parse_moves("R R U", 3))
    twin.finish_turn()
    assert out.reward > 0 and twin.state.moves_tried == 5 and twin.team_outcome() > before[2]
    assert (env.state.position, env.state.moves_tried, env.team_outcome(), len(env.state.events)) == before
    assert env.current_turn == 1 and twin.current_turn == 2
    other = env.fork()  # a second candidate from the same state scores on its own copy
    assert other.execute(parse_moves("L", 3)).info["outcomes"] == ["out_of_bounds"]
    assert other.team_outcome() == pytest.approx(before[2] - 0.1 + 0.05)  # blocked at d = 5: -0.1 + 0.01 * 5
    assert env.team_outcome() == before[2] and env.state.grid == twin.state.grid == other.state.grid


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"reward": "dense"}, "reward"),
        ({"shaping_gamma": 0.0}, "shaping_gamma"),
        ({"shaping_gamma": 1.5}, "shaping_gamma"),
        ({"step_cost": -0.01}, "step_cost"),
        ({"blocked_move_cost": -1}, "blocked_move_cost"),
        ({"shaping_lambda": -1}, "shaping_lambda"),
        ({"goal_reward": -1}, "goal_reward"),
        ({"optimal_bonus": -0.5}, "optimal_bonus"),
        ({"max_moves_per_turn": 0}, "max_moves_per_turn"),
    ],
)
def test_bad_reward_knobs_are_config_errors_naming_the_knob(bad, match) -> None:
    with pytest.raises(EnvConfigError, match=match):
        PlanPathEnv.validate_config(bad)


@pytest.mark.parametrize("name", ["plan-path-learn", "plan-path-learn-tree", "plan-path-learn-solo"])
def test_learn_configs_share_one_board_and_the_prompts_state_its_move_limit(name) -> None:
    config = load_config(name)
    options = config.env.options
    assert {k: options[k] for k in LEARN_BOARD} == LEARN_BOARD
    knobs = PlanPathEnv.validate_config({"max_turns": config.env.max_turns, **options})
    env = PlanPathEnv({"task_id": "plan-path/7", "seed": 7}, knobs)
    limit = knobs.max_moves_per_turn
    for agent in [resolve_agent_class(a.class_path)(tokenizer=TOK) for a in config.agents]:
        assert f" {limit} moves" in agent.turn_prompt(env)  # "at most 4 moves", "the next 4 moves at most"
        assert agent.parse_response("Moves: " + "R " * (limit + 2), env).moves == ("R",) * limit
