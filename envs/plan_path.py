"""``plan-path``: a generated grid path-planning env for two cooperating agents.

A grid has walls, a start and a goal. A **planner** proposes the next few moves and an **executor**
reads the plan and the board and issues the moves the env actually makes. The env is their only
channel: the planner's plan and what happened to the executor's moves (moved, blocked by a wall,
out of bounds, no moves in the text) sit in ``PlanPathState`` and both read them on their next turn.
In the spirit of PettingLLMs' Plan-Path task (arXiv 2510.11062); the rules and rewards here are our
own and documented with formulas in docs/plan-path.md.

Why generated: tasks are a seed each (``{"task_id", "seed"}``); the grid is a function of the seed
and the difficulty knobs in ``PlanPathConfig`` (grid size, wall density, shortest-path length), so
nothing is downloaded, every machine sees the same grids, and the knobs can be turned from the
config without regenerating a file. A task may also give its grid explicitly (``{"task_id",
"grid": ["S.#", "..G"]}``), which tests and hand-made tasks use.

Rewards are per turn (process rewards) so that later reward mixing can combine them with the team
reward: ``TurnOutcome.info`` holds ``progress`` and ``local_reward`` of the turn, and
``PlanPathEnv.episode_info()`` the episode's ``team_reward``. Two reward modes (``PlanPathConfig.reward``):
``progress`` (normalised distance decrease per turn; team reward 1 when the goal was reached) and
``shaped`` (the reference's dense per-move reward: step cost, blocked-move cost, potential-based shaping
on the BFS distance, goal and optimal-path bonuses; team reward = the episode's cumulative shaped reward).
``PlanPathEnv.team_outcome()`` is the team reward the episode would get if it ended now.
"""

from __future__ import annotations

import random
import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, model_validator

from pettingflow.envs.base import Env, EnvConfig, TaskDataError, TurnOutcome

Cell = tuple[int, int]
MOVES: dict[str, Cell] = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
MOVE_WORDS: dict[str, str] = {"U": "up", "D": "down", "L": "left", "R": "right"}
MAX_GENERATION_ATTEMPTS = 200
DEFAULT_NUM_TASKS = 200


class PlanPathConfig(EnvConfig):
    """Difficulty knobs of ``plan-path``; every key has a default so ``{}`` is a valid config.

    ``max_turns`` (from ``EnvConfig``) counts agent calls over both agents: planner and executor
    alternate, so ``max_turns: 6`` gives the team three plan + execute rounds.
    """

    rows: int = Field(4, ge=2, le=16, description="Grid height.")
    cols: int = Field(4, ge=2, le=16, description="Grid width.")
    wall_density: float = Field(
        0.2, ge=0.0, le=0.6, description="Share of cells that are walls: exactly round(density * rows * cols)."
    )
    min_path_len: int = Field(
        2, ge=1, description="Shortest start-goal path (BFS moves) of a generated grid, at least."
    )
    max_path_len: int | None = Field(
        4, ge=1, description="Shortest start-goal path of a generated grid, at most; null: no upper bound."
    )
    max_moves_per_turn: int = Field(
        3, ge=1, description="Moves read from one reply (planner and executor); later ones are ignored."
    )
    invalid_penalty: float = Field(
        0.5, ge=0.0, description="Subtracted from a turn's reward when its reply holds no move at all."
    )
    answer_prefix: bool = Field(
        False,
        description="Start each reply with its label ('Plan:' / 'Moves:') in the prompt, so the model continues a "
        "move list instead of writing prose (agents' answer_prefix; needs env.sample_layout=per_turn).",
    )
    show_offset: bool = Field(
        True, description="Also tell both agents how many rows/columns the goal is away (an easier board reading)."
    )
    reward: Literal["progress", "shaped"] = Field(
        "progress",
        description="progress: a turn earns its normalised distance decrease, the team 1 if the goal is reached; "
        "shaped: a turn earns the sum of its moves' shaped rewards (the coefficients below), the team the "
        "episode's cumulative shaped reward (docs/plan-path.md).",
    )
    step_cost: float = Field(0.01, ge=0.0, description="shaped: subtracted for every move that was made.")
    blocked_move_cost: float = Field(
        0.1, ge=0.0, description="shaped: subtracted for a move into a wall or off the board (it ends the walk)."
    )
    shaping_gamma: float = Field(
        0.99, gt=0.0, le=1.0, description="shaped: discount of the potential-based shaping, gamma in (0, 1]."
    )
    shaping_lambda: float = Field(
        1.0, ge=0.0, description="shaped: weight of the shaping term lambda * (gamma * phi(next) - phi(cur))."
    )
    goal_reward: float = Field(1.0, ge=0.0, description="shaped: added to the move that reaches the goal.")
    optimal_bonus: float = Field(
        0.5,
        ge=0.0,
        description="shaped: also added when the goal is reached after exactly the shortest number of moves tried.",
    )

    @model_validator(mode="after")
    def _feasible(self) -> PlanPathConfig:
        cells = self.rows * self.cols  # density <= 0.6 on >= 4 cells always leaves 2 free cells
        if self.max_path_len is not None and self.max_path_len < self.min_path_len:
            raise ValueError(f"max_path_len={self.max_path_len} is below min_path_len={self.min_path_len}")
        longest = cells - round(self.wall_density * cells) - 1
        if self.min_path_len > longest:
            raise ValueError(
                f"min_path_len={self.min_path_len} cannot fit a {self.rows}x{self.cols} grid with "
                f"{cells - longest - 1} walls (at most {longest} moves); lower it or enlarge the grid"
            )
        return self


# --------------------------------------------------------------------------------------------------
# the grid
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Grid:
    """A rectangular board: ``walls`` are blocked cells; (row, col) with row 0 at the top."""

    rows: int
    cols: int
    walls: frozenset[Cell]
    start: Cell
    goal: Cell

    def inside(self, cell: Cell) -> bool:
        return 0 <= cell[0] < self.rows and 0 <= cell[1] < self.cols

    def free(self, cell: Cell) -> bool:
        return self.inside(cell) and cell not in self.walls

    def distances_to_goal(self) -> dict[Cell, int]:
        """BFS moves from every reachable free cell to the goal (4-connected, unit cost)."""
        dist = {self.goal: 0}
        queue = deque([self.goal])
        while queue:
            cell = queue.popleft()
            for dr, dc in MOVES.values():
                nxt = (cell[0] + dr, cell[1] + dc)
                if nxt not in dist and self.free(nxt):
                    dist[nxt] = dist[cell] + 1
                    queue.append(nxt)
        return dist

    def shortest_path(self, cell: Cell | None = None) -> list[str] | None:
        """One shortest move sequence from ``cell`` (default: the start) to the goal; None if unreachable.

        Ties are broken in the order U, D, L, R, so the answer is deterministic (scripted tests use it).
        """
        dist = self.distances_to_goal()
        here = self.start if cell is None else cell
        if here not in dist:
            return None
        path: list[str] = []
        while here != self.goal:
            for move, (dr, dc) in MOVES.items():
                nxt = (here[0] + dr, here[1] + dc)
                if dist.get(nxt) == dist[here] - 1:
                    path.append(move)
                    here = nxt
                    break
        return path

    def to_rows(self) -> list[str]:
        """The grid as strings: ``#`` wall, ``.`` free, ``S`` start, ``G`` goal (``Grid.from_rows`` reads it)."""
        out = []
        for r in range(self.rows):
            line = []
            for c in range(self.cols):
                cell = (r, c)
                mark = "#" if cell in self.walls else "."
                line.append("S" if cell == self.start else "G" if cell == self.goal else mark)
            out.append("".join(line))
        return out

    @classmethod
    def from_rows(cls, lines: Sequence[str]) -> Grid:
        """Parse ``to_rows`` output; exactly one ``S`` and one ``G``, equal row lengths, only ``#.SG``."""
        lines = [str(line) for line in lines]
        if not lines or not lines[0]:
            raise ValueError("a plan-path grid needs at least one non-empty row")
        width = len(lines[0])
        walls, starts, goals = set(), [], []
        for r, line in enumerate(lines):
            if len(line) != width:
                raise ValueError(f"grid row {r} has {len(line)} cells, row 0 has {width}; rows must be equally long")
            for c, ch in enumerate(line):
                if ch == "#":
                    walls.add((r, c))
                elif ch == "S":
                    starts.append((r, c))
                elif ch == "G":
                    goals.append((r, c))
                elif ch != ".":
                    raise ValueError(f"grid cell ({r}, {c}) is {ch!r}; use '#' wall, '.' free, 'S' start, 'G' goal")
        if len(starts) != 1 or len(goals) != 1:
            raise ValueError(f"a grid needs exactly one 'S' and one 'G', got {len(starts)} and {len(goals)}")
        return cls(len(lines), width, frozenset(walls), starts[0], goals[0])


def generate_grid(seed: int, config: PlanPathConfig) -> Grid:
    """The grid of ``seed`` under ``config``'s knobs: same (seed, knobs) -> same grid, on every machine.

    Walls: exactly ``round(wall_density * rows * cols)`` cells. Start: a random free cell. Goal: a
    random free cell whose BFS distance from the start lies in [min_path_len, max_path_len]. A wall
    layout without such a goal is drawn again (at most ``MAX_GENERATION_ATTEMPTS`` times), so every
    generated grid is solvable by construction.
    """
    rng = random.Random(f"plan-path/{seed}")
    cells = [(r, c) for r in range(config.rows) for c in range(config.cols)]
    n_walls = round(config.wall_density * len(cells))
    high = config.max_path_len if config.max_path_len is not None else len(cells)
    for _ in range(MAX_GENERATION_ATTEMPTS):
        walls = frozenset(rng.sample(cells, n_walls))
        free = [c for c in cells if c not in walls]
        start = rng.choice(free)
        # distances from the start equal distances to it: moves are reversible
        dist = Grid(config.rows, config.cols, walls, start, start).distances_to_goal()
        goals = [c for c in free if config.min_path_len <= dist.get(c, -1) <= high]
        if goals:
            return Grid(config.rows, config.cols, walls, start, rng.choice(goals))
    raise ValueError(
        f"no solvable grid for seed {seed} after {MAX_GENERATION_ATTEMPTS} layouts "
        f"({config.rows}x{config.cols}, wall_density={config.wall_density}, min_path_len={config.min_path_len}); "
        "lower wall_density or min_path_len, or enlarge the grid"
    )


def grid_of_task(task: Mapping[str, Any], config: PlanPathConfig) -> Grid:
    """A task's grid: its explicit ``grid`` rows, else the one generated from its ``seed``."""
    if task.get("grid") is not None:
        grid = Grid.from_rows(task["grid"])
    elif task.get("seed") is not None:
        grid = generate_grid(int(task["seed"]), config)
    else:
        raise ValueError(f"plan-path task {task.get('task_id', '?')!r} needs a 'seed' or a 'grid' (list of rows)")
    if grid.start == grid.goal or grid.start in grid.walls or grid.goal in grid.walls:
        raise ValueError("start and goal must be distinct free cells")
    if grid.start not in grid.distances_to_goal():
        raise ValueError(f"plan-path task {task.get('task_id', '?')!r}: the goal cannot be reached from the start")
    return grid


def load_plan_path_tasks(num_tasks: int = DEFAULT_NUM_TASKS) -> list[dict[str, Any]]:
    """``num_tasks`` tasks, one seed each (0 .. num_tasks-1). The held-out split hashes the task ids
    (``humaneval.split_tasks``), so train and validation grids come from disjoint seeds."""
    if num_tasks < 2:
        raise ValueError(f"plan-path needs at least 2 tasks (one to train on, one held out), got {num_tasks}")
    return [{"task_id": f"plan-path/{seed}", "seed": seed} for seed in range(num_tasks)]


# --------------------------------------------------------------------------------------------------
# moves: parsing and walking
# --------------------------------------------------------------------------------------------------
_PREFIXED = re.compile(r"^[\s*>#-]*(?:plan|moves?|actions?)\s*[:=]\s*(.*)$", re.IGNORECASE | re.MULTILINE)
_TOKEN = re.compile(r"\b(?:(?i:up|down|left|right)|[UDLR]+)\b")


@dataclass(frozen=True)
class ParsedMoves:
    """Moves read from a reply: at most ``limit`` of them; ``ignored`` counts the ones past the limit."""

    moves: tuple[str, ...]
    ignored: int = 0

    @property
    def valid(self) -> bool:
        """A reply is valid text when at least one move was found in it."""
        return bool(self.moves)

    def text(self) -> str:
        return " ".join(self.moves)


def _tokens(text: str) -> list[str]:
    out: list[str] = []
    for token in _TOKEN.findall(text):
        word = token.lower()
        if word in ("up", "down", "left", "right"):
            out.append(word[0].upper())
        else:
            out.extend(token)  # "R", or "RRD" written without spaces
    return out


def parse_moves(text: str, limit: int) -> ParsedMoves:
    """The moves in a reply: ``U D L R`` (upper case, ``RRD`` too) or ``up down left right`` (any case).

    The first line that starts with ``Plan:``, ``Moves:`` or ``Action:`` and holds a move wins;
    without one, every move in the whole text counts, in order. The first ``limit`` are kept.
    Forgiving on purpose: a small model's prose around the moves should not make the turn invalid.
    """
    candidates = [m.group(1) for m in _PREFIXED.finditer(text)] + [text]
    for candidate in candidates:
        found = _tokens(candidate)
        if found:
            return ParsedMoves(tuple(found[:limit]), max(len(found) - limit, 0))
    return ParsedMoves(())


@dataclass(frozen=True)
class MoveResult:
    """One attempted move: ``outcome`` is ``moved``, ``wall`` or ``out_of_bounds``; ``position`` is where
    the walker is afterwards (unchanged unless it moved)."""

    move: str
    outcome: str
    position: Cell


@dataclass(frozen=True)
class Walk:
    """Moves tried from ``start`` in order, stopping at the first illegal one or at the goal."""

    start: Cell
    steps: tuple[MoveResult, ...]
    end: Cell
    not_tried: int
    reached_goal: bool


def walk(grid: Grid, position: Cell, moves: Iterable[str]) -> Walk:
    """Apply ``moves`` from ``position``. An illegal move (into a wall or off the board) leaves the
    position unchanged and ends the walk; reaching the goal ends it too. Moves after that are not tried."""
    moves = list(moves)
    steps: list[MoveResult] = []
    here = position
    for move in moves:
        if here == grid.goal:
            break
        dr, dc = MOVES[move]
        nxt = (here[0] + dr, here[1] + dc)
        if not grid.inside(nxt):
            steps.append(MoveResult(move, "out_of_bounds", here))
            break
        if nxt in grid.walls:
            steps.append(MoveResult(move, "wall", here))
            break
        here = nxt
        steps.append(MoveResult(move, "moved", here))
    return Walk(position, tuple(steps), here, len(moves) - len(steps), here == grid.goal)


def describe_walk(w: Walk) -> str:
    """What happened, in words both agents read: one clause per tried move."""
    parts = []
    for s in w.steps:
        where = f"row {s.position[0]}, column {s.position[1]}"
        if s.outcome == "moved":
            parts.append(f"{s.move} moved to {where}")
        elif s.outcome == "wall":
            parts.append(f"{s.move} was blocked by a wall (stayed at {where})")
        else:
            parts.append(f"{s.move} would leave the board (stayed at {where})")
    text = "; ".join(parts) + "."
    if w.reached_goal:
        text += " The goal was reached."
    if w.not_tried:
        text += f" {w.not_tried} later move{'s were' if w.not_tried > 1 else ' was'} not made."
    return text


# --------------------------------------------------------------------------------------------------
# rewards (docs/plan-path.md)
# --------------------------------------------------------------------------------------------------
def progress(distance_before: int, distance_after: int, start_distance: int) -> float:
    """Normalised progress: (d_before - d_after) / d_start; sums over turns to (d_start - d_end) / d_start."""
    return (distance_before - distance_after) / start_distance


def team_reward(goal_reached: bool) -> float:
    """The team reward of the ``progress`` mode at the end of an episode: 1 when the goal was reached, else 0."""
    return 1.0 if goal_reached else 0.0


def potential_shaping(distance_before: int, distance_after: int, gamma: float, lam: float) -> float:
    """Potential-based shaping of one move with phi(p) = -d(p), the BFS distance to the goal:

    ``lam * (gamma * phi(p') - phi(p)) = lam * (d(p) - gamma * d(p'))``.

    A blocked move (p' = p) earns ``lam * (1 - gamma) * d(p)``, a small positive amount: as in the reference,
    the blocked-move cost is what makes it a loss.
    """
    return lam * (distance_before - gamma * distance_after)


def shaped_move_reward(
    moved: bool,
    distance_before: int,
    distance_after: int,
    *,
    reached_goal: bool,
    optimal: bool,
    config: PlanPathConfig,
) -> float:
    """The ``shaped`` reward of one tried move (``config`` holds the coefficients):

    ``r = -(step_cost if moved else blocked_move_cost) + lam * (d(p) - gamma * d(p'))
    + goal_reward * [p' is the goal] + optimal_bonus * [p' is the goal and optimal]``,

    where ``optimal`` means the moves tried in the episode so far, this one included, number exactly the
    start's shortest-path length (so no move was blocked or wasted).
    """
    base = -config.step_cost if moved else -config.blocked_move_cost
    reward = base + potential_shaping(distance_before, distance_after, config.shaping_gamma, config.shaping_lambda)
    if reached_goal:
        reward += config.goal_reward + (config.optimal_bonus if optimal else 0.0)
    return reward


def shaped_walk_rewards(
    w: Walk, distances: Mapping[Cell, int], moves_before: int, start_distance: int, config: PlanPathConfig
) -> list[float]:
    """The shaped reward of every tried move of ``w`` (``shaped_move_reward``), in order; ``moves_before``
    counts the moves tried earlier in the episode (for the optimal-path bonus). Moves that were not
    tried (after a blocked move or the goal) earn nothing. A turn's shaped reward is the sum."""
    out = []
    here = w.start
    for i, step in enumerate(w.steps):
        goal = step.outcome == "moved" and distances[step.position] == 0
        out.append(
            shaped_move_reward(
                step.outcome == "moved",
                distances[here],
                distances[step.position],
                reached_goal=goal,
                optimal=goal and moves_before + i + 1 == start_distance,
                config=config,
            )
        )
        here = step.position
    return out


# --------------------------------------------------------------------------------------------------
# state and env
# --------------------------------------------------------------------------------------------------
@dataclass
class PlanPathState:
    """What both agents share. Everything here may be shown to them (there is nothing hidden)."""

    task_id: str
    grid: Grid
    position: Cell
    start_distance: int
    distance: int
    plan: ParsedMoves | None = None  # the latest plan (None before the planner's first turn)
    last_walk: Walk | None = None  # the executor's latest moves and what happened
    last_invalid: str | None = None  # which role's latest reply held no move ("planner"/"executor")
    moves_tried: int = 0  # moves the executor tried so far (made or blocked), for the optimal-path bonus
    shaped_return: float = 0.0  # the cumulative shaped reward of the executor's tried moves (``shaped`` mode)
    events: list[dict[str, Any]] = field(default_factory=list)  # one per turn, for prompts and debugging

    @property
    def offset(self) -> Cell:
        """Goal minus position: (rows down, columns right); negative means up / left."""
        return (self.grid.goal[0] - self.position[0], self.grid.goal[1] - self.position[1])


class PlanPathEnv(Env):
    """Grid path planning for a planner and an executor (``plan-path``). See docs/plan-path.md."""

    Config = PlanPathConfig
    config: PlanPathConfig

    @classmethod
    def validate_task(cls, task: Mapping[str, Any], config: EnvConfig) -> None:
        """The task's grid can be built (from ``grid`` rows or a ``seed``) and its goal reached."""
        field = "grid" if task.get("grid") is not None else "seed"
        if field == "grid" and (isinstance(task["grid"], str) or not isinstance(task["grid"], Sequence)):
            raise TaskDataError("grid", "must be a list of row strings such as ['S.#', '..G']")
        try:
            grid_of_task(task, cls.validate_config(config))
        except (ValueError, TypeError) as exc:
            raise TaskDataError(field, str(exc)) from exc

    def initial_state(self) -> PlanPathState:
        grid = grid_of_task(self.task, self.config)
        self._distances = grid.distances_to_goal()
        d0 = self._distances[grid.start]
        return PlanPathState(
            task_id=str(self.task.get("task_id", "?")),
            grid=grid,
            position=grid.start,
            start_distance=d0,
            distance=d0,
        )

    def solved(self) -> bool:
        return self.state.position == self.state.grid.goal

    def fork(self) -> PlanPathEnv:
        """Tree rollouts: the state is plain data; the distance table is read-only and shared."""
        return self._copy_episode()

    def distance(self, cell: Cell) -> int:
        """BFS distance from ``cell`` to the goal (cells the walker can stand on are always reachable)."""
        return self._distances[cell]

    def _shaped(self, w: Walk | None) -> list[float]:
        """The shaped reward of each move ``w`` tried from the current position (none without a walk)."""
        if w is None:
            return []
        return shaped_walk_rewards(w, self._distances, self.state.moves_tried, self.state.start_distance, self.config)

    def _turn_info(
        self,
        role: str,
        parsed: ParsedMoves,
        walk_: Walk | None,
        before: int,
        credited: float,
        move_rewards: list[float] | None = None,
    ) -> dict[str, Any]:
        """The row's ``info_json["turn"]``: ``progress`` is the distance decrease this turn actually made
        (0 on planner turns), ``local_reward`` the acting agent's reward (``credited`` minus the penalty).
        In ``shaped`` mode also ``move_rewards`` (each tried move's shaped reward) and ``shaped_reward`` (their sum)."""
        s = self.state
        invalid = not parsed.valid
        info = {
            "role": role,
            "moves": parsed.text(),
            "invalid": invalid,
            "ignored_moves": parsed.ignored,
            "outcomes": [st.outcome for st in walk_.steps] if walk_ else [],
            "distance_before": before,
            "distance_after": s.distance,
            "progress": progress(before, s.distance, s.start_distance),
            "local_reward": credited - (self.config.invalid_penalty if invalid else 0.0),
        }
        if move_rewards is not None:
            info["move_rewards"] = move_rewards
            info["shaped_reward"] = sum(move_rewards)
        s.events.append({"turn": self.current_turn, **info, "position": list(s.position)})
        return info

    def submit_plan(self, parsed: ParsedMoves) -> TurnOutcome:
        """The planner's turn: store the plan for the executor; nothing moves.

        Reward (``progress``): ``plan_progress``, the progress the plan would make if executed as written
        from the current position (same rules as a real walk). Reward (``shaped``): the shaped reward that
        simulated walk would earn. Success: that walk would reach the goal.
        """
        s = self.state
        s.plan = parsed
        s.last_invalid = "planner" if not parsed.valid else None
        simulated = walk(s.grid, s.position, parsed.moves)
        planned = progress(s.distance, self.distance(simulated.end), s.start_distance)
        if self.config.reward == "shaped":
            move_rewards = self._shaped(simulated)
            info = self._turn_info("planner", parsed, simulated, s.distance, sum(move_rewards), move_rewards)
        else:
            info = self._turn_info("planner", parsed, simulated, s.distance, planned)
        info["plan_progress"] = planned
        return TurnOutcome(info["local_reward"], simulated.reached_goal, info)

    def execute(self, parsed: ParsedMoves) -> TurnOutcome:
        """The executor's turn: make the moves. Reward (``progress``): the normalised progress actually
        made; (``shaped``): the shaped reward of the moves made, which also adds to the team's
        ``shaped_return``. Success: the goal is reached."""
        s = self.state
        before = s.distance
        move_rewards: list[float] = []
        if parsed.valid:
            result = walk(s.grid, s.position, parsed.moves)
            move_rewards = self._shaped(result)  # before the position and move count change
            s.position, s.distance, s.last_walk = result.end, self.distance(result.end), result
            s.moves_tried += len(result.steps)
            s.shaped_return += sum(move_rewards)
            s.last_invalid = None
        else:
            result = None
            s.last_walk, s.last_invalid = None, "executor"
        if self.config.reward == "shaped":
            info = self._turn_info("executor", parsed, result, before, sum(move_rewards), move_rewards)
        else:
            info = self._turn_info("executor", parsed, result, before, progress(before, s.distance, s.start_distance))
        return TurnOutcome(info["local_reward"], self.solved(), info)

    def team_outcome(self) -> float:
        """The team reward the episode would get if it ended now: ``progress`` mode 1.0 when the walker
        stands on the goal, else 0.0; ``shaped`` mode the cumulative shaped reward of the executor's moves
        so far (goal and optimal bonus included; the reply-without-moves penalty is an agent's, not the team's).
        Tree rollouts credit each candidate with this value on its own fork."""
        if self.config.reward == "shaped":
            return self.state.shaped_return
        return team_reward(self.solved())

    def episode_info(self) -> dict[str, Any]:
        """Per-episode values every row of the episode carries (``info_json``): the team reward
        (``team_outcome()`` at the end) and the distances it came from. The engine reads this once the
        episode is over."""
        s = self.state
        return {
            "team_reward": self.team_outcome(),
            "goal_reached": self.solved(),
            "start_distance": s.start_distance,
            "final_distance": s.distance,
            "grid": s.grid.to_rows(),
        }
