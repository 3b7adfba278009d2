"""The sudoku env (docs/sudoku.md): generation, parsing, rewards, fork, config errors, and two-agent
episodes through the real rollout engine (independent and tree mode) with a scripted LLM."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from rollout_fakes import CharChatTokenizer, ScriptedLLM

from pettingflow.agents import resolve_agent_class
from pettingflow.agents.sudoku_agents import FillerAgent, ProposerAgent
from pettingflow.configs import load_config
from pettingflow.configs.settings import DatasetSettings
from pettingflow.envs import EnvConfigError, load_tasks, resolve_env_class
from pettingflow.envs.base import TaskDataError
from pettingflow.envs.sudoku import (
    SIZE,
    ParsedFills,
    SudokuEnv,
    count_solutions,
    generate_puzzle,
    is_valid_placement,
    load_sudoku_tasks,
    parse_fills,
    place,
    solved,
)

TOK = CharChatTokenizer()
# a hand-made board: solution 1234/3412/2143/4321, three blanks
BOARD = ["12.4", "3412", "2.43", "432."]


def env_of(board=BOARD, **config) -> SudokuEnv:
    env = SudokuEnv({"task_id": "t", "board": list(board)}, {"max_turns": 6, **config})
    env.reset()
    return env


def solve(board):
    for r in range(SIZE):
        for c in range(SIZE):
            if board[r][c] == 0:
                for d in range(1, SIZE + 1):
                    if is_valid_placement(board, r, c, d):
                        out = solve(place(board, r, c, d))
                        if out:
                            return out
                return None
    return board


def test_generation_is_deterministic_and_valid() -> None:
    for seed in range(50):
        for blanks in (1, 4, 8, 12):
            b = generate_puzzle(seed, blanks)
            assert b == generate_puzzle(seed, blanks)
            assert sum(v == 0 for row in b for v in row) == blanks
            assert count_solutions(b, 1) >= 1 and solved(solve(b))
    assert generate_puzzle(0, 4) != generate_puzzle(1, 4)


def test_split_and_registered_names() -> None:
    tasks = load_sudoku_tasks(50)
    assert [t["seed"] for t in tasks] == list(range(50))
    split = load_tasks(DatasetSettings(source="sudoku", num_tasks=50, validation_fraction=0.2))
    train, held = {t["seed"] for t in split.train}, {t["seed"] for t in split.validation}
    assert len(held) == 10 and not train & held and train | held == set(range(50))
    assert resolve_env_class("sudoku") is SudokuEnv
    assert resolve_agent_class("sudoku-proposer") is ProposerAgent
    assert resolve_agent_class("sudoku-filler") is FillerAgent
    assert load_config("sudoku").env.class_path == "sudoku"


@pytest.mark.parametrize(
    ("text", "fills", "ignored"),
    [
        ("Fills: 0 2 3", ((0, 2, 3),), 0),
        ("0,2=3 and 2,1=1; 3 3 1", ((0, 2, 3), (2, 1, 1)), 1),
        ("I think row zero", (), 0),
        ("9 9 9", (), 0),
    ],
)
def test_parse_fills(text, fills, ignored) -> None:
    assert parse_fills(text, 2) == ParsedFills(fills, ignored)


def test_rewards_on_the_hand_made_board() -> None:
    env = env_of()
    out = env.commit(parse_fills("0 2 3, 2 1 2", 2))  # 0 2 3 correct; 2 1 2 conflicts (row has 2)
    assert out.info["outcomes"] == ["ok", "conflict"]
    assert out.reward == pytest.approx(1.0 - 0.5) and not out.success
    assert env.team_outcome() == 0.0
    out = env.commit(parse_fills("hmm", 2))
    assert out.reward == -0.5 and out.info["invalid"]
    prop = env.propose(parse_fills("2 1 1, 3 3 1", 2))
    assert prop.reward == 2.0 and prop.success and env.team_outcome() == 0.0  # proposing places nothing
    out = env.commit(parse_fills("2 1 1, 3 3 1", 2))
    assert out.reward == 2.0 and out.success and env.team_outcome() == 1.0
    assert env.episode_info()["team_reward"] == 1.0


def test_fork_independence() -> None:
    env = env_of()
    twin = env.fork()
    twin.commit(parse_fills("0 2 3", 2))
    assert env.state.board[0][2] == 0 and twin.state.board[0][2] == 3
    assert not env.state.events and twin.state.events


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"blanks": 0}, "blanks"),
        ({"blanks": 17}, "blanks"),
        ({"max_fills_per_turn": 0}, "max_fills_per_turn"),
        ({"invalid_penalty": -1}, "invalid_penalty"),
    ],
)
def test_bad_knobs_are_config_errors(bad, match) -> None:
    with pytest.raises(EnvConfigError, match=match):
        SudokuEnv.validate_config(bad)


@pytest.mark.parametrize("board", [["1234"], ["11..", "....", "....", "...."], ["12x4", "3412", "2143", "4321"]])
def test_bad_task_boards_are_refused(board) -> None:
    with pytest.raises(TaskDataError):
        SudokuEnv.validate_task({"board": board}, {})


# --------------------------------------------------------------------------------------------------
# the engine
# --------------------------------------------------------------------------------------------------
def grid_of_prompt(prompt: str):
    lines = prompt.split("The grid:\n")[-1].splitlines()[:SIZE]
    return tuple(tuple(0 if ch == "." else int(ch) for ch in line.split()) for line in lines)


def solver_reply(model: str, prompt: str, params: dict[str, Any]) -> str:
    board = grid_of_prompt(prompt)
    sol = solve(board)
    blanks = [(r, c) for r in range(SIZE) for c in range(SIZE) if board[r][c] == 0]
    return "Fills: " + ", ".join(f"{r} {c} {sol[r][c]}" for r, c in blanks[:2])


def engine_rows(reply, *, tree_branches=None, layout="per_turn", max_turns=8):
    from pettingflow.agents import build_agent
    from pettingflow.envs import EnvCache
    from pettingflow.rollout.engine import AgentBinding, ExecutionEngine
    from pettingflow.rollout.local import episode_specs
    from pettingflow.rollout.records import build_rows

    config = load_config("sudoku", [f"env.max_turns={max_turns}", f"env.sample_layout={layout}"])
    tasks = load_sudoku_tasks(4)[:2]
    tree = tree_branches is not None
    specs = episode_specs(config, tasks, group_size=1 if tree else 2, seed_namespace="t/", env_cache=EnvCache())
    llm = ScriptedLLM(TOK, reply=reply)
    bindings = {
        a.name: AgentBinding(client=llm, served_model=a.name, tokenizer=TOK, policy_name="shared")
        for a in config.agents
    }
    extra = {"tree_branches": tree_branches, "tree_select": "best"} if tree else {}
    engine = ExecutionEngine(
        lambda: [build_agent(a, agent_idx=i, tokenizer=TOK, layout=layout) for i, a in enumerate(config.agents)],
        bindings,
        max_turns=max_turns,
        token_budget=10_000,
        layout=layout,
        show_progress=False,
        **extra,
    )
    records, stats = asyncio.run(engine.run(specs))
    rows = build_rows(records, layout, "run", 0, group_size=1 if tree else 2)
    return records, stats, rows, llm


@pytest.mark.parametrize("tree", [None, 2])
def test_scripted_solver_succeeds_through_the_engine(tree) -> None:
    records, stats, rows, llm = engine_rows(solver_reply, tree_branches=tree)
    assert records and all(r.done and not r.truncated for r in records)
    assert stats.per_agent["filler"]["success_rate"] == 1.0
    for row in rows:
        info = json.loads(row["info_json"])
        assert info["team_reward"] == 1.0
        assert row["reward"] == pytest.approx(info["turn"]["local_reward"]) and info["turn"]["local_reward"] > 0
    assert any("The proposer suggests: " in c["prompt"] for c in llm.calls)


@pytest.mark.parametrize("tree", [None, 2])
def test_garbage_writer_fails_with_invalid_penalties(tree) -> None:
    records, stats, rows, _ = engine_rows(lambda model, prompt, params: "banana", tree_branches=tree)
    assert all(r.truncated for r in records)
    assert stats.per_agent["filler"]["success_rate"] == 0.0
    for row in rows:
        info = json.loads(row["info_json"])
        assert info["team_reward"] == 0.0 and info["turn"]["invalid"] and row["reward"] == -0.5


def test_answer_prefix_starts_the_reply_with_fills() -> None:
    tok = CharChatTokenizer()
    env = env_of(answer_prefix=True)
    proposer, filler = ProposerAgent(tokenizer=tok), FillerAgent(tokenizer=tok, agent_idx=1)
    assert tok.decode(proposer.update_from_env(0, env).token_ids).endswith("<assistant>Fills:")
    assert proposer.update_from_model(0, env, " 0 2 3").fills == ((0, 2, 3),)  # parsed with the prefix
    assert not tok.decode(ProposerAgent(tokenizer=tok).update_from_env(0, env_of()).token_ids).endswith("Fills:")
    asyncio.run(proposer.step(env))
    assert tok.decode(filler.update_from_env(1, env).token_ids).endswith("<assistant>Fills:")


def test_show_blanks_lists_the_empty_cells_and_prefills_the_first_one() -> None:
    tok = CharChatTokenizer()
    env = env_of(answer_prefix=True, show_blanks=True)  # BOARD's empty cells: 0 2, 2 1, 3 3
    proposer, filler = ProposerAgent(tokenizer=tok), FillerAgent(tokenizer=tok, agent_idx=1)
    prompt = tok.decode(proposer.update_from_env(0, env).token_ids)
    assert "Empty cells (row column): 0 2; 2 1; 3 3." in prompt and "which digit (1-4) goes there" in prompt
    assert prompt.endswith("<assistant>Fills: 0 2")
    proposer.update_from_model(0, env, " 1")
    asyncio.run(proposer.step(env))
    assert tok.decode(filler.update_from_env(1, env).token_ids).endswith("<assistant>Fills: 0 2")
    assert filler.update_from_model(1, env, " 3").fills == ((0, 2, 3),)
    asyncio.run(filler.step(env))
    assert env.state.board[0][2] == 3  # 3 is the one digit row 0 lacks: placed
    assert tok.decode(proposer.update_from_env(2, env).token_ids).endswith("<assistant>Fills: 2 1")  # the next blank
