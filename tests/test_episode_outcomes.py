"""Every episode counts: how an episode ends (solved, failed, max_turns, not_finished), the envs that
say so, and success rates over every episode asked for, with counts that add up.

The word game is the case that found it: a describer gives a clue, a guesser guesses; a clue that contains the word
ends the episode in failure before the guesser's turn. Those episodes must count as the guesser's failures."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
from rollout_fakes import CharChatTokenizer, Prompt, ScriptedLLM

from pettingflow.analysis.outcomes import (
    agent_scores,
    asked_episodes,
    count_episodes,
    episode_successes,
    outcome_label,
    step_request,
)
from pettingflow.configs.settings import SamplingSettings
from pettingflow.envs.base import Env, EnvConfig, outcome_hook_problems, terminal_outcome
from pettingflow.rollout.engine import AgentBinding, ExecutionEngine, group_specs
from pettingflow.rollout.records import build_rows

TOK = CharChatTokenizer()


# ------------------------------------------------------------------------------------------ the word game
@dataclass
class WordState:
    clue: str = ""
    guess: str = ""
    leaked: bool = False


class WordGameEnv(Env):
    """The describer's clue must not contain the word (that loses the episode); the guesser must name it."""

    def initial_state(self) -> WordState:
        return WordState()

    def solved(self) -> bool:
        return self.state.guess == self.task["word"]

    def failed(self) -> bool:
        return self.state.leaked

    def give_clue(self, clue: str) -> tuple[float, bool]:
        self.state.clue = clue
        self.state.leaked = self.task["word"] in clue
        return (0.0, False) if self.state.leaked else (0.5, True)

    def make_guess(self, guess: str) -> tuple[float, bool]:
        self.state.guess = guess.strip()
        return (1.0, True) if self.solved() else (0.0, False)


class WordAgent:
    """Shows the clue (guesser) or the word (describer); acts through the env's action, then finishes the turn."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sampling = SamplingSettings(temperature=1.0, max_tokens=16)
        self.reset()

    def reset(self) -> None:
        self.action, self.agent_reward, self.success = "", 0.0, False

    def update_from_env(self, turn: int, env: WordGameEnv) -> Prompt:
        seen = env.task["word"] if self.name == "describer" else env.state.clue
        messages = [{"role": "user", "content": f"{self.name}:{seen}"}]
        return Prompt(messages, TOK.apply_chat_template(messages, add_generation_prompt=True))

    def update_from_model(self, turn: int, env: WordGameEnv, response: str) -> str:
        self.action = response
        return response

    async def step(self, env: WordGameEnv) -> None:
        act = env.give_clue if self.name == "describer" else env.make_guess
        self.agent_reward, self.success = act(self.action)
        env.finish_turn()


def word_reply(model: str, prompt: str, params: dict[str, Any]) -> str:
    """The describer leaks 'apple' and describes anything else as 'fruit'; the guesser always says 'pear'."""
    if model == "describer":
        return "an apple" if "describer:apple" in prompt else "fruit"
    return "pear"


def run_word_game(words: list[str], samples: int, token_budget: int = 1000, max_turns: int = 2):
    env_config = EnvConfig(max_turns=max_turns)

    def make_env(spec: Any) -> WordGameEnv:
        return WordGameEnv(spec.task, env_config, env_idx=spec.id.env_idx, rollout_idx=spec.id.rollout_idx)

    llm = ScriptedLLM(TOK, reply=word_reply)
    bindings = {n: AgentBinding(llm, n, TOK, policy_name="shared") for n in ("describer", "guesser")}
    engine = ExecutionEngine(
        lambda: [WordAgent("describer"), WordAgent("guesser")],
        bindings,
        max_turns=max_turns,
        token_budget=token_budget,
        show_progress=False,
    )
    specs = group_specs([{"word": w} for w in words], samples, 0, "word-game", make_env)
    records, stats = asyncio.run(engine.run(specs))
    return records, stats, build_rows(records, "per_turn", "run-w", 0, samples)


# ------------------------------------------------------------------------------------------ the env contract
def test_a_failed_episode_ends_early_as_failed_not_solved_nor_truncated() -> None:
    env = WordGameEnv({"word": "apple"}, {"max_turns": 4})
    env.give_clue("apple pie")
    env.finish_turn()
    assert (env.done, env.truncated, env.outcome, env.current_turn) == (True, False, "failed", 1)
    with pytest.raises(RuntimeError, match="already done"):
        env.finish_turn()
    env.reset()
    assert (env.done, env.outcome) == (False, None)


def test_solved_wins_over_failed_and_running_out_of_turns_is_max_turns() -> None:
    env = WordGameEnv({"word": "pear"}, {"max_turns": 2})
    env.state.leaked = True
    env.make_guess("pear")
    env.finish_turn()
    assert (env.outcome, env.truncated) == ("solved", False)  # solved wins over failed
    env = WordGameEnv({"word": "pear"}, {"max_turns": 2})
    for _ in range(2):
        env.make_guess("plum")
        env.finish_turn()
    assert (env.done, env.truncated, env.outcome) == (True, True, "max_turns")


def test_forks_carry_the_outcome() -> None:
    env = WordGameEnv({"word": "apple"}, {"max_turns": 4})
    env.give_clue("apple")
    env.finish_turn()
    assert env._copy_episode().outcome == "failed"


def test_objects_without_an_outcome_get_one_from_done_truncated_and_their_hooks() -> None:
    @dataclass
    class Duck:
        done: bool
        truncated: bool = False

    assert terminal_outcome(Duck(False)) is None
    assert terminal_outcome(Duck(True)) == "solved"  # done alone used to mean solved
    assert terminal_outcome(Duck(True, True)) == "max_turns"

    class LostDuck(Duck):
        def solved(self) -> bool:
            return False

    assert terminal_outcome(LostDuck(True)) == "failed"


def test_the_check_names_hooks_that_finish_turn_cannot_call() -> None:
    class TakesArgument(WordGameEnv):
        def failed(self, strict: bool) -> bool:
            return strict

    class AsProperty(WordGameEnv):
        @property
        def solved(self) -> bool:  # type: ignore[override]
            return False

    class SetsDone(WordGameEnv):
        done = True

    assert outcome_hook_problems(WordGameEnv) == []
    assert "TakesArgument.failed takes ['strict']" in outcome_hook_problems(TakesArgument)[0]
    assert "AsProperty.solved must be a plain method" in outcome_hook_problems(AsProperty)[0]
    assert "defines 'done' on the class" in outcome_hook_problems(SetsDone)[0]


# ------------------------------------------------------------------------------------------ counting
def test_episodes_the_env_ended_before_the_guessers_turn_count_as_its_failures() -> None:
    # apple: leaked, failed before the guess; pear: guessed, solved; plum: wrong guess, out of turns
    records, stats, rows = run_word_game(["apple", "pear", "plum"], samples=2)
    assert [r.outcome for r in records] == ["failed"] * 2 + ["solved"] * 2 + ["max_turns"] * 2
    assert stats.outcomes == {"solved": 2.0, "failed": 2.0, "max_turns": 2.0, "not_finished": 0.0}
    guesser = stats.per_agent["guesser"]
    assert (guesser["episodes"], guesser["episodes_acted"], guesser["success_rate"]) == (6.0, 4.0, 2 / 6)
    assert guesser["reward_mean"] == pytest.approx(2 / 6)  # the leaked episodes count as reward 0
    assert {r["outcome"] for r in rows if r["env_idx"] == 0} == {"failed"}
    # the same from the stored rows, over the episodes the step asked for
    assert episode_successes(rows, "guesser", asked_episodes(3, 2)) == {
        0: [False, False],
        1: [True, True],
        2: [False, False],
    }
    assert agent_scores(rows, asked_episodes(3, 2))["guesser"] == guesser


def test_a_token_budget_spent_before_the_guesser_is_not_finished_and_still_counted() -> None:
    records, stats, rows = run_word_game(["pear"], samples=1, token_budget=len("fruit"))
    assert records[0].outcome == "not_finished" and records[0].truncated and not records[0].done
    assert stats.per_agent["guesser"]["episodes"] == 1.0 and stats.per_agent["guesser"]["success_rate"] == 0.0
    assert count_episodes(rows, "guesser", 1, 1).outcomes == {"not_finished": 1}


@pytest.mark.parametrize("tasks,samples", [(3, 2), (4, 3)])
def test_the_counts_add_up_to_the_episodes_asked_for(tasks: int, samples: int) -> None:
    """Task 0 leaks, the others are mixed; the last task leaves no row at all (asked for, never stored)."""
    words = ["apple", "pear", "plum", "fig"][: tasks - 1]
    _, _, rows = run_word_game(words, samples)
    counts = count_episodes(rows, "guesser", tasks, samples)
    assert counts.episodes == tasks * samples == sum(counts.outcomes.values())
    assert counts.agent_acted + counts.ended_before_agent == counts.episodes
    assert counts.outcomes["no_rows"] == samples and counts.ended_before_agent == 2 * samples
    assert (
        counts.success_rate
        == sum(map(sum, episode_successes(rows, "guesser", asked_episodes(tasks, samples)).values())) / counts.episodes
    )
    text = counts.text()
    assert text.startswith(f"{tasks} tasks x {samples} samples = {tasks * samples} episodes (")
    assert f"{2 * samples} ended before guesser's turn, counted as failures" in text


def test_what_a_step_asked_for_comes_from_its_metadata_or_else_the_config() -> None:
    from pettingflow.configs.loader import load_config

    config = load_config("code-env", ["validation.samples_per_task=3", "env.group_size=4"])
    assert step_request({"tasks": ["a", "b"], "samples_per_task": 5}, config, "validation") == (2, 5)
    assert step_request({"tasks": ["a", "b"]}, config, "validation") == (2, 3)
    assert step_request({"tasks": ["a"]}, config, "rollouts") == (1, 4)
    assert step_request({}, config, "rollouts") is None


def test_labels_say_how_it_ended() -> None:
    assert [outcome_label(o) for o in ("solved", "failed", "max_turns", "not_finished")] == [
        "solved",
        "failed",
        "ended at max turns",
        "not finished",
    ]
    assert outcome_label("other") == "other"  # never silently "solved"


# ------------------------------------------------------------------------------------------ shipped envs
def test_plan_path_ends_solved_when_the_goal_is_reached_and_at_max_turns_otherwise() -> None:
    from pettingflow.envs.plan_path import PlanPathEnv, parse_moves

    env = PlanPathEnv({"task_id": "p", "grid": ["S.G"]}, {"max_turns": 4})
    env.submit_plan(parse_moves("R R", 8))
    env.finish_turn()
    env.execute(parse_moves("R R", 8))
    env.finish_turn()
    assert (env.outcome, env.current_turn) == ("solved", 2)
    env = PlanPathEnv({"task_id": "p", "grid": ["S.G"]}, {"max_turns": 2})
    env.submit_plan(parse_moves("L", 8))
    env.finish_turn()
    env.execute(parse_moves("L", 8))
    env.finish_turn()
    assert (env.outcome, env.truncated) == ("max_turns", True)


def test_sudoku_ends_solved_when_the_grid_is_full_and_at_max_turns_otherwise() -> None:
    from pettingflow.envs.sudoku import SudokuEnv, parse_fills

    board = ["1234", "3412", "2143", "432."]
    env = SudokuEnv({"task_id": "s", "board": board}, {"max_turns": 4})
    env.commit(parse_fills("3 3 1", 2))
    env.finish_turn()
    assert env.outcome == "solved"
    env = SudokuEnv({"task_id": "s", "board": board}, {"max_turns": 1})
    env.commit(parse_fills("3 3 2", 2))  # a conflict: not placed
    env.finish_turn()
    assert env.outcome == "max_turns"


def test_math_tool_ends_solved_on_a_right_answer_and_at_max_turns_otherwise() -> None:
    from fractions import Fraction

    from pettingflow.envs.math_tool import MathToolEnv

    task = {"task_id": "m", "question": "Compute 3 + 4.", "answer": "7"}
    env = MathToolEnv(task, {"max_turns": 4}, sandbox=object())  # the reasoner's turn runs nothing
    env.submit_answer(Fraction(7))
    env.finish_turn()
    assert env.outcome == "solved"
    env = MathToolEnv(task, {"max_turns": 1}, sandbox=object())
    env.submit_answer(Fraction(8))
    env.finish_turn()
    assert env.outcome == "max_turns"
