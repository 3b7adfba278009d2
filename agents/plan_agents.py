"""The agents of ``plan-path``: a planner that proposes moves and an executor that makes them, and a
solo walker (both roles in one agent) for the single-agent baseline of docs/results.md.

Prompts are short and regular because the default model is SmolLM2-135M-Instruct: the board is a
few lines of single characters, positions are spelled out as row/column, the answer is one line
(``Plan: R R D`` / ``Moves: R R D``). Parsing (``envs.plan_path.parse_moves``) is forgiving, and a
reply without any move is not an error but an invalid turn the env reports to both agents.
Neither agent sees the other's reply directly: the plan and what happened live in ``env.state``.
"""

from __future__ import annotations

from pettingflow.agents.base import EnvActionAgent
from pettingflow.envs.base import Env, TurnOutcome
from pettingflow.envs.plan_path import ParsedMoves, PlanPathEnv, PlanPathState, describe_walk, parse_moves

LEGEND = "# is a wall, . is free, A is you, G is the goal. Row 0 is the top row, column 0 the left column."
MOVE_HELP = (
    "Each move is one letter: U (up), D (down), L (left), R (right). A move into a wall or off the board is not made."
)


def plan_env(env: Env) -> PlanPathEnv:
    """``env`` as a ``PlanPathEnv`` (a clear error if an agent was paired with the wrong env)."""
    if not isinstance(env, PlanPathEnv) or not isinstance(env.state, PlanPathState):
        raise TypeError(f"plan-path agents need a PlanPathEnv with a PlanPathState, got {env!r}")
    return env


def render_board(s: PlanPathState) -> str:
    """The board with the walker as ``A`` (the start is not marked once it was left)."""
    lines = []
    for r in range(s.grid.rows):
        row = []
        for c in range(s.grid.cols):
            cell = (r, c)
            row.append(
                "A" if cell == s.position else "G" if cell == s.grid.goal else "#" if cell in s.grid.walls else "."
            )
        lines.append(" ".join(row))
    return "\n".join(lines)


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def where(s: PlanPathState, show_offset: bool) -> str:
    """Position and goal in words, optionally with the offset between them."""
    text = (
        f"You are at row {s.position[0]}, column {s.position[1]}. "
        f"The goal is at row {s.grid.goal[0]}, column {s.grid.goal[1]}."
    )
    if show_offset:
        dr, dc = s.offset
        parts = []
        if dr:
            parts.append(_count(abs(dr), "row") + (" down" if dr > 0 else " up"))
        if dc:
            parts.append(_count(abs(dc), "column") + (" right" if dc > 0 else " left"))
        if parts:
            text += f" It is {' and '.join(parts)} from you."
    return text


def last_execution(s: PlanPathState, mover: str = "the executor") -> str | None:
    """What the latest moving turn did, as every agent is told; None before anything moved.
    ``mover`` names who moved: "the executor" in the team, "you" for the solo walker."""
    if s.last_invalid == "executor":
        whose = "your" if mover == "you" else f"{mover}'s"
        return f"Last turn {whose} reply had no moves, so nothing happened."
    if s.last_walk is not None:
        return f"Last turn {mover} moved: {describe_walk(s.last_walk)}"
    return None


def turns_left(env: Env, who: str = "the team") -> str:
    left = env.max_turns - env.current_turn
    return f"Turns left for {who}: {left}."


def board_parts(env: Env, mover: str = "the executor") -> list[str]:
    """What every role sees first: the board, its legend, where the agent and the goal are, the last walk."""
    penv = plan_env(env)
    s = penv.state
    parts = ["The board:", render_board(s), LEGEND, where(s, penv.config.show_offset)]
    happened = last_execution(s, mover)
    if happened:
        parts.append(happened)
    return parts


class _GridAgent(EnvActionAgent):
    """A plan-path role: replies are move lists (at most ``max_moves_per_turn``); ``submit`` hands them to the env."""

    #: the answer format's label ("Plan" / "Moves"); with the env's ``answer_prefix`` the reply starts with it
    label: str = "Moves"

    def answer_prefix(self, env: Env) -> str:
        return f"{self.label}:" if plan_env(env).config.answer_prefix else ""

    def parse_response(self, response_text: str, env: Env) -> ParsedMoves:
        return parse_moves(response_text, plan_env(env).config.max_moves_per_turn)


class PlannerAgent(_GridAgent):
    """Proposes the next moves (``plan-path-planner``). Reward: the progress its plan would make."""

    default_name = "planner"
    label = "Plan"
    system_prompt = (
        "You are the planner of a team that walks a grid to a goal. You plan the moves; a partner makes them."
    )

    def turn_prompt(self, env: Env) -> str:
        limit = plan_env(env).config.max_moves_per_turn
        parts = [
            *board_parts(env),
            MOVE_HELP,
            turns_left(env),
            f"Plan the next {_count(limit, 'move')} at most toward G, avoiding walls. "
            "Reply with one line like: Plan: R D",
        ]
        return "\n".join(parts)

    def submit(self, env: Env) -> TurnOutcome:
        return plan_env(env).submit_plan(self.current_action)


class ExecutorAgent(_GridAgent):
    """Makes the moves the env executes (``plan-path-executor``). Reward: the progress actually made."""

    default_name = "executor"
    decides_outcome = True  # only its moves reach the goal
    system_prompt = "You are the executor of a team that walks a grid to a goal. A partner plans; you make the moves."

    def turn_prompt(self, env: Env) -> str:
        penv = plan_env(env)
        s, limit = penv.state, penv.config.max_moves_per_turn
        parts = board_parts(env)
        if s.plan is None:
            parts.append("The planner has not planned yet.")
        elif s.plan.valid:
            parts.append(f"The planner's plan: {s.plan.text()}")
        else:
            parts.append("The planner's reply had no moves.")
        parts += [
            MOVE_HELP,
            turns_left(env),
            f"Check the plan against the board and make at most {_count(limit, 'move')} toward G. "
            "Reply with one line like: Moves: R D",
        ]
        return "\n".join(parts)

    def submit(self, env: Env) -> TurnOutcome:
        return plan_env(env).execute(self.current_action)


class WalkerAgent(_GridAgent):
    """Plans and makes the moves alone (``plan-path-walker``): the single-agent baseline.

    Its prompt is the executor's without the partner: the same board, legend, move help and answer
    format, so a solo run and a team run differ in the team, not in how the task is put. Its turns are
    executor turns (``PlanPathEnv.execute``): reward = progress actually made; success = goal reached.
    With ``env.max_turns: k`` it gets ``k`` moving turns, where a team with ``2k`` turns gets ``k``
    executor turns and ``k`` plans.
    """

    default_name = "walker"
    decides_outcome = True
    system_prompt = "You walk a grid to a goal."

    def turn_prompt(self, env: Env) -> str:
        limit = plan_env(env).config.max_moves_per_turn
        parts = [
            *board_parts(env, mover="you"),
            MOVE_HELP,
            turns_left(env, "you"),
            f"Make at most {_count(limit, 'move')} toward G, avoiding walls. Reply with one line like: Moves: R D",
        ]
        return "\n".join(parts)

    def submit(self, env: Env) -> TurnOutcome:
        return plan_env(env).execute(self.current_action)
