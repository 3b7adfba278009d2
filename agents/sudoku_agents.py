"""The agents of ``sudoku``: a proposer that suggests cell fills and a filler that commits them.

Neither agent sees the other's reply: the proposal and what the env did live in ``env.state``.
Replies are fills ``row col digit`` (0-based row/column); parsing is ``envs.sudoku.parse_fills``.
"""

from __future__ import annotations

from pettingflow.agents.base import EnvActionAgent
from pettingflow.envs.base import Env, TurnOutcome
from pettingflow.envs.sudoku import ParsedFills, SudokuEnv, SudokuState, empty_cells, parse_fills, render

RULES = (
    "Fill the 4x4 grid with digits 1-4 so every row, column and 2x2 box holds each digit once. "
    ". is an empty cell. Rows and columns are numbered 0-3 from the top left."
)


def sudoku_env(env: Env) -> SudokuEnv:
    if not isinstance(env, SudokuEnv) or not isinstance(env.state, SudokuState):
        raise TypeError(f"sudoku agents need a SudokuEnv with a SudokuState, got {env!r}")
    return env


def board_parts(env: Env) -> list[str]:
    senv = sudoku_env(env)
    s = senv.state
    parts = ["The grid:", render(s.board), RULES]
    if senv.config.show_blanks:
        parts.append("Empty cells (row column): " + "; ".join(f"{r} {c}" for r, c in empty_cells(s.board)) + ".")
    if s.last_invalid == "filler":
        parts.append("Last turn the filler's reply had no fills, so nothing changed.")
    elif s.last_result:
        parts.append("Last fills: " + ", ".join(s.last_result) + ".")
    return parts


def named_cell(env: Env) -> tuple[int, int] | None:
    """The cell the prompt asks about: with ``show_blanks``, the first empty one (None without, or when full)."""
    senv = sudoku_env(env)
    cells = empty_cells(senv.state.board) if senv.config.show_blanks else []
    return cells[0] if cells else None


def reply_example(env: Env) -> str:
    """The format line. With ``show_blanks`` it asks for the first empty cell's digit and gives no example triple:
    SmolLM2-135M copied the example's digit (a conflict) or its placeholder letter (docs/sudoku.md)."""
    cell = named_cell(env)
    if cell is None:
        return "Reply with one line like: Fills: 0 1 3"
    r, c = cell
    return f"Start with row {r} column {c}: which digit (1-4) goes there? Reply as: Fills: row column digit"


class _SudokuAgent(EnvActionAgent):
    label = "Fills"

    def answer_prefix(self, env: Env) -> str:
        """With the env's ``answer_prefix``, the reply starts with ``Fills:``: the untrained model wrote no
        triple in most replies without it; with ``show_blanks`` too, with the first empty cell's row and column,
        so the model's first choice is a digit (it copied coordinates and digits from the example otherwise;
        docs/sudoku.md has the measurements)."""
        if not sudoku_env(env).config.answer_prefix:
            return ""
        cell = named_cell(env)
        return f"{self.label}: {cell[0]} {cell[1]}" if cell else f"{self.label}:"

    def parse_response(self, response_text: str, env: Env) -> ParsedFills:
        return parse_fills(response_text, sudoku_env(env).config.max_fills_per_turn)


class ProposerAgent(_SudokuAgent):
    """Suggests fills (``sudoku-proposer``). Reward: what its fills would earn if committed."""

    default_name = "proposer"
    system_prompt = "You propose moves for a team solving a small Sudoku; a partner writes them in."

    def turn_prompt(self, env: Env) -> str:
        n = sudoku_env(env).config.max_fills_per_turn
        return "\n".join([*board_parts(env), f"Propose up to {n} fills as row column digit. {reply_example(env)}"])

    def submit(self, env: Env) -> TurnOutcome:
        return sudoku_env(env).propose(self.current_action)


class FillerAgent(_SudokuAgent):
    """Commits fills the env applies (``sudoku-filler``). Reward: correct fills minus conflicting ones."""

    default_name = "filler"
    decides_outcome = True
    system_prompt = "You write moves into a small Sudoku for a team; a partner proposes them."

    def turn_prompt(self, env: Env) -> str:
        senv = sudoku_env(env)
        s, n = senv.state, senv.config.max_fills_per_turn
        parts = board_parts(env)
        if s.proposal is None:
            parts.append("The proposer has not proposed yet.")
        elif s.proposal.valid:
            parts.append(f"The proposer suggests: {s.proposal.text()}")
        else:
            parts.append("The proposer's reply had no fills.")
        parts.append(f"Check the suggestion and write up to {n} fills. {reply_example(env)}")
        return "\n".join(parts)

    def submit(self, env: Env) -> TurnOutcome:
        return sudoku_env(env).commit(self.current_action)
