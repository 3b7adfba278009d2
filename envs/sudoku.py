"""``sudoku``: a 4x4 Sudoku (2x2 boxes, digits 1-4) for a proposer and a filler (docs/sudoku.md).

The proposer suggests cell fills (``r c d`` triples); the filler commits fills that the env applies.
The env is the only channel between them: the proposal lives in ``env.state``. Puzzles are generated
from a seed: a full valid grid, then ``blanks`` cells removed. The reward accepts any valid completion
(the puzzle need not have a unique solution): a fill is *correct* when it breaks no row, column or box
rule and the resulting grid can still be completed.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from pettingflow.envs.base import Env, EnvConfig, TaskDataError, TurnOutcome

SIZE = 4
BOX = 2
DEFAULT_NUM_TASKS = 200
Board = tuple[tuple[int, ...], ...]  # 0 = blank


class SudokuConfig(EnvConfig):
    """Difficulty knobs of ``sudoku``; every key has a default so ``{}`` is a valid config."""

    blanks: int = Field(4, ge=1, le=16, description="Cells removed from the full grid (the difficulty knob).")
    max_fills_per_turn: int = Field(2, ge=1, le=16, description="Fills read from one reply; later ones are ignored.")
    correct_reward: float = Field(
        1.0, ge=0.0, description="Per-turn reward for each committed fill that keeps the grid completable."
    )
    conflict_penalty: float = Field(
        0.5, ge=0.0, description="Subtracted for each fill that breaks a rule, overwrites a clue or dead-ends the grid."
    )
    invalid_penalty: float = Field(0.5, ge=0.0, description="Subtracted when a reply holds no fill at all.")
    show_blanks: bool = Field(
        False,
        description="List the empty cells (row column) under the grid and use the first one in the reply example: "
        "the model then chooses digits, not coordinates it cannot read off the grid.",
    )
    answer_prefix: bool = Field(
        False,
        description="Start each reply with 'Fills:' in the prompt, so the model continues with the triples "
        "(agents' answer_prefix; needs env.sample_layout=per_turn).",
    )


def is_valid_placement(board: Board, r: int, c: int, d: int) -> bool:
    """``d`` may go in the blank cell (r, c): no equal digit in its row, column or box."""
    if board[r][c] != 0:
        return False
    if any(board[r][j] == d for j in range(SIZE)) or any(board[i][c] == d for i in range(SIZE)):
        return False
    br, bc = BOX * (r // BOX), BOX * (c // BOX)
    return all(board[i][j] != d for i in range(br, br + BOX) for j in range(bc, bc + BOX))


def place(board: Board, r: int, c: int, d: int) -> Board:
    rows = [list(row) for row in board]
    rows[r][c] = d
    return tuple(tuple(row) for row in rows)


def count_solutions(board: Board, limit: int = 2) -> int:
    """Completions of ``board`` (stops at ``limit``)."""
    for r in range(SIZE):
        for c in range(SIZE):
            if board[r][c] == 0:
                n = 0
                for d in range(1, SIZE + 1):
                    if is_valid_placement(board, r, c, d):
                        n += count_solutions(place(board, r, c, d), limit - n)
                        if n >= limit:
                            return n
                return n
    return 1


def solved(board: Board) -> bool:
    return all(all(v != 0 for v in row) for row in board) and count_solutions(board) == 1 and _consistent(board)


def _consistent(board: Board) -> bool:
    for r in range(SIZE):
        for c in range(SIZE):
            d = board[r][c]
            if d and not is_valid_placement(place(board, r, c, 0), r, c, d):
                return False
    return True


def generate_puzzle(seed: int, blanks: int) -> Board:
    """A full valid grid shuffled from ``seed`` (digit relabelling, row/column swaps inside bands and
    stacks, band/stack swaps), then ``blanks`` random cells emptied. Same (seed, blanks) -> same board."""
    rng = random.Random(f"sudoku/{seed}")
    base = [[(BOX * (r % BOX) + r // BOX + c) % SIZE + 1 for c in range(SIZE)] for r in range(SIZE)]
    digits = list(range(1, SIZE + 1))
    rng.shuffle(digits)
    bands = rng.sample(range(BOX), BOX)
    rows = [b * BOX + i for b in bands for i in rng.sample(range(BOX), BOX)]
    stacks = rng.sample(range(BOX), BOX)
    cols = [s * BOX + j for s in stacks for j in rng.sample(range(BOX), BOX)]
    full = [[digits[base[r][c] - 1] for c in cols] for r in rows]
    for r, c in rng.sample([(r, c) for r in range(SIZE) for c in range(SIZE)], blanks):
        full[r][c] = 0
    return tuple(tuple(row) for row in full)


def board_of_task(task: Mapping[str, Any], config: SudokuConfig) -> Board:
    """A task's board: explicit ``board`` rows (digits, ``.``/``0`` blank), else generated from ``seed``."""
    if task.get("board") is not None:
        rows = task["board"]
        if isinstance(rows, str) or not isinstance(rows, Sequence) or len(rows) != SIZE:
            raise ValueError(f"board must be {SIZE} row strings such as '1.3.'")
        out = []
        for row in rows:
            cells = str(row).replace(" ", "")
            if len(cells) != SIZE or any(ch not in ".01234" for ch in cells):
                raise ValueError(f"board row {row!r} must have {SIZE} cells of 1-{SIZE} or '.'")
            out.append(tuple(0 if ch in ".0" else int(ch) for ch in cells))
        board = tuple(out)
        if not _consistent(board) or count_solutions(board, 1) == 0:
            raise ValueError("the board has no valid completion")
        return board
    if task.get("seed") is not None:
        return generate_puzzle(int(task["seed"]), config.blanks)
    raise ValueError(f"sudoku task {task.get('task_id', '?')!r} needs a 'seed' or a 'board'")


def load_sudoku_tasks(num_tasks: int = DEFAULT_NUM_TASKS) -> list[dict[str, Any]]:
    """``num_tasks`` tasks, one seed each; the held-out split hashes task ids (``humaneval.split_tasks``)."""
    if num_tasks < 2:
        raise ValueError(f"sudoku needs at least 2 tasks (one to train on, one held out), got {num_tasks}")
    return [{"task_id": f"sudoku/{seed}", "seed": seed} for seed in range(num_tasks)]


_FILL = re.compile(r"(?<!\d)([0-3])\s*[, ]\s*([0-3])\s*[,=: ]\s*([1-4])(?!\d)")


@dataclass(frozen=True)
class ParsedFills:
    fills: tuple[tuple[int, int, int], ...]
    ignored: int = 0

    @property
    def valid(self) -> bool:
        return bool(self.fills)

    def text(self) -> str:
        return "; ".join(f"{r} {c} {d}" for r, c, d in self.fills)


def parse_fills(text: str, limit: int) -> ParsedFills:
    """Fills ``row col digit`` (0-based row and column, e.g. ``0 1 3`` or ``0,1=3``), at most ``limit``."""
    found = [(int(a), int(b), int(d)) for a, b, d in _FILL.findall(text)]
    return ParsedFills(tuple(found[:limit]), max(0, len(found) - limit))


def empty_cells(board: Board) -> list[tuple[int, int]]:
    """The blank cells, row by row."""
    return [(r, c) for r in range(SIZE) for c in range(SIZE) if board[r][c] == 0]


def render(board: Board) -> str:
    return "\n".join(" ".join(str(v) if v else "." for v in row) for row in board)


def team_reward(is_solved: bool) -> float:
    return 1.0 if is_solved else 0.0


@dataclass
class SudokuState:
    task_id: str
    start: Board
    board: Board
    proposal: ParsedFills | None = None
    last_invalid: str | None = None
    last_result: list[str] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)


class SudokuEnv(Env):
    """4x4 Sudoku for a proposer and a filler (``sudoku``). See docs/sudoku.md."""

    Config = SudokuConfig
    config: SudokuConfig

    @classmethod
    def validate_task(cls, task: Mapping[str, Any], config: EnvConfig) -> None:
        field_ = "board" if task.get("board") is not None else "seed"
        try:
            board_of_task(task, cls.validate_config(config))
        except (ValueError, TypeError) as exc:
            raise TaskDataError(field_, str(exc)) from exc

    def initial_state(self) -> SudokuState:
        b = board_of_task(self.task, self.config)
        return SudokuState(task_id=str(self.task.get("task_id", "?")), start=b, board=b)

    def solved(self) -> bool:
        return solved(self.state.board)

    def fork(self) -> SudokuEnv:
        """Tree rollouts: the state is plain immutable boards plus lists the copy duplicates."""
        return self._copy_episode()

    def judge(self, board: Board, fills: Sequence[tuple[int, int, int]]) -> tuple[Board, list[str]]:
        """Apply ``fills`` in order: ``ok`` (placed; the grid stays completable), ``conflict`` (breaks a rule
        or fills a non-blank cell: not placed), ``dead-end`` (no rule broken but no completion left: not placed)."""
        out = []
        for r, c, d in fills:
            if not is_valid_placement(board, r, c, d):
                out.append("conflict")
                continue
            nxt = place(board, r, c, d)
            if count_solutions(nxt, 1) == 0:
                out.append("dead-end")
                continue
            board = nxt
            out.append("ok")
        return board, out

    def _reward(self, outcomes: list[str], parsed: ParsedFills) -> float:
        ok = outcomes.count("ok")
        reward = self.config.correct_reward * ok - self.config.conflict_penalty * (len(outcomes) - ok)
        return reward - (self.config.invalid_penalty if not parsed.valid else 0.0)

    def _info(self, role: str, parsed: ParsedFills, outcomes: list[str], before: int) -> dict[str, Any]:
        s = self.state
        info = {
            "role": role,
            "fills": parsed.text(),
            "invalid": not parsed.valid,
            "ignored_fills": parsed.ignored,
            "outcomes": outcomes,
            "blanks_before": before,
            "blanks_after": sum(v == 0 for row in s.board for v in row),
            "local_reward": self._reward(outcomes, parsed),
        }
        s.events.append({"turn": self.current_turn, **info})
        return info

    def propose(self, parsed: ParsedFills) -> TurnOutcome:
        """Proposer: store the proposal; nothing is placed. Reward: what the fills would earn if committed."""
        s = self.state
        s.proposal = parsed
        s.last_invalid = None if parsed.valid else "proposer"
        board, outcomes = self.judge(s.board, parsed.fills)
        before = sum(v == 0 for row in s.board for v in row)
        info = self._info("proposer", parsed, outcomes, before)
        return TurnOutcome(info["local_reward"], solved(board), info)

    def commit(self, parsed: ParsedFills) -> TurnOutcome:
        """Filler: the env places the fills. Reward: correct fills minus conflicting ones. Success: solved."""
        s = self.state
        before = sum(v == 0 for row in s.board for v in row)
        s.board, outcomes = self.judge(s.board, parsed.fills)
        s.last_result = outcomes
        s.last_invalid = None if parsed.valid else "filler"
        info = self._info("filler", parsed, outcomes, before)
        return TurnOutcome(info["local_reward"], self.solved(), info)

    def team_outcome(self) -> float:
        """1.0 when the grid is solved now, else 0.0."""
        return team_reward(self.solved())

    def episode_info(self) -> dict[str, Any]:
        s = self.state
        return {
            "team_reward": self.team_outcome(),
            "solved": self.solved(),
            "start_blanks": sum(v == 0 for row in s.start for v in row),
            "final_blanks": sum(v == 0 for row in s.board for v in row),
            "board": render(s.board).splitlines(),
        }
