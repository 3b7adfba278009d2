"""``math-tool``: generated math problems for a tool agent that writes code and a reasoner that answers.

A **tool** agent writes a short Python program for the problem; the env runs it in the sandbox
(``make_sandbox``: bubblewrap by default, the run's Ray sandbox pool when ``rollout.use_ray``; model code
never runs unsandboxed) and stores what it printed in ``MathToolState``. A **reasoner** reads the problem
and the program's output and gives the final answer. In the spirit of PettingLLMs' math workflow (a
reasoning agent and a tool agent, arXiv 2510.11062); the problems, rules and rewards here are our own and
documented with formulas in docs/math-tool.md.

Tasks are a seed each (``{"task_id", "seed"}``): the problem is a function of the seed and the difficulty
knobs in ``MathToolConfig`` (problem kinds, operations, operand size, fractions), so nothing is downloaded and
every machine sees the same problems. A task may also give its problem explicitly (``{"task_id",
"question", "answer"}``, the answer an integer or a fraction string such as ``"7/2"``), which tests use.

Rewards are per turn: ``TurnOutcome.info`` holds the acting agent's ``local_reward``;
``MathToolEnv.episode_info()`` the episode's ``team_reward`` (1 when the reasoner's latest answer is right).
``MathToolEnv.team_outcome()`` is that team reward if the episode ended now.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from pettingflow.configs.settings import SandboxSettings
from pettingflow.envs.base import Env, EnvConfig, TaskDataError, TurnOutcome

if TYPE_CHECKING:
    from pettingflow.envs.sandbox import ExecResult, Sandbox

Kind = Literal["arithmetic", "word"]
OPS = ("+", "-", "*", "/")
MAX_GENERATION_ATTEMPTS = 200
DEFAULT_NUM_TASKS = 200
#: a value read from text equals the answer when |value - answer| <= REL_TOL * max(1, |answer|): exact for
#: integers and fractions written as such, and a float print such as 0.3333333333333333 counts for 1/3
REL_TOL = 1e-6
#: characters of the program's stdout / stderr kept in the state and shown to the agents
SHOWN_OUTPUT_CHARS = 300


class MathToolConfig(EnvConfig):
    """Difficulty knobs and rewards of ``math-tool``; every key has a default so ``{}`` is a valid config.

    ``max_turns`` counts agent calls over both agents: tool and reasoner alternate, so ``max_turns: 4``
    gives the team two program + answer rounds.
    """

    sandbox: SandboxSettings = Field(
        default_factory=lambda: SandboxSettings(timeout_s=5.0, cpu_time_s=5),
        description="Where and under which limits the tool's programs run (docs/sandbox.md).",
    )
    kinds: list[Kind] = Field(
        default_factory=lambda: ["arithmetic", "word"],
        min_length=1,
        description="Problem kinds drawn from (uniformly per seed): arithmetic expressions, short word problems.",
    )
    min_ops: int = Field(1, ge=1, le=6, description="arithmetic: operations in an expression, at least.")
    max_ops: int = Field(2, ge=1, le=6, description="arithmetic: operations in an expression, at most.")
    max_operand: int = Field(20, ge=2, le=10_000, description="Largest number drawn into a problem.")
    allow_fractions: bool = Field(
        True, description="Answers may be non-integer rationals (a division that does not come out even)."
    )
    max_program_chars: int = Field(2000, ge=10, description="Longer programs are cut to this many characters.")
    ran_weight: float = Field(
        0.2, ge=0.0, le=1.0, description="w in r_tool = w * [ran cleanly] + (1 - w) * [printed the answer]."
    )
    invalid_penalty: float = Field(
        0.0, ge=0.0, description="Subtracted from a turn's reward when its reply holds no program / no answer."
    )
    answer_prefix: bool = Field(
        False,
        description="Start each reply in the prompt: the tool's with a ```python fence and 'print(', the reasoner's "
        "with 'Answer:' (agents' answer_prefix; needs env.sample_layout=per_turn).",
    )

    @model_validator(mode="after")
    def _ops(self) -> MathToolConfig:
        if self.max_ops < self.min_ops:
            raise ValueError(f"max_ops={self.max_ops} is below min_ops={self.min_ops}")
        return self


# --------------------------------------------------------------------------------------------------
# problems
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """A question and its exact answer."""

    question: str
    answer: Fraction
    kind: str = "given"


def format_number(value: Fraction) -> str:
    """``7``, ``-3`` or ``7/2``: how answers are written in prompts, docs and logs."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _expression(rng: random.Random, n_ops: int, config: MathToolConfig) -> tuple[str, Fraction]:
    """A random expression with ``n_ops`` operations, fully parenthesised below the top, and its value."""
    if n_ops == 0:
        v = rng.randint(1, config.max_operand)
        return str(v), Fraction(v)
    left_ops = rng.randint(0, n_ops - 1)
    op = rng.choice(OPS)
    ltext, lval = _expression(rng, left_ops, config)
    rtext, rval = _expression(rng, n_ops - 1 - left_ops, config)
    if op == "/" and rval == 0:
        raise ZeroDivisionError
    value = {"+": lval + rval, "-": lval - rval, "*": lval * rval, "/": lval / rval if rval else Fraction(0)}[op]
    wrap = lambda text, ops: f"({text})" if ops else text  # noqa: E731
    return f"{wrap(ltext, left_ops)} {op} {wrap(rtext, n_ops - 1 - left_ops)}", value


def _arithmetic(rng: random.Random, config: MathToolConfig) -> Problem:
    n_ops = rng.randint(config.min_ops, config.max_ops)
    text, value = _expression(rng, n_ops, config)
    return Problem(f"Compute {text}.", value, "arithmetic")


def _word(rng: random.Random, config: MathToolConfig) -> Problem:
    """One of a few short word templates; the numbers come from ``rng``, the answer from the same numbers."""
    m = config.max_operand
    name = rng.choice(["Ana", "Ben", "Chen", "Dara", "Eli", "Fay"])
    template = rng.randrange(4)
    if template == 0:
        a, b = rng.randint(2, m), rng.randint(2, m)
        c = rng.randint(1, a * b)
        return Problem(
            f"{name} buys {a} boxes with {b} pencils in each box and gives away {c} pencils. "
            "How many pencils are left?",
            Fraction(a * b - c),
            "word",
        )
    if template == 1:
        a, b = rng.randint(1, m), rng.randint(1, m)
        c = rng.randint(2, max(2, m // 2))
        return Problem(
            f"{name} has {a} red and {b} blue marbles and shares all of them equally among {c} friends. "
            "How many marbles does each friend get?",
            Fraction(a + b, c),
            "word",
        )
    if template == 2:
        a, b = rng.randint(2, m), rng.randint(2, 9)
        return Problem(
            f"A car drives at {a} km per hour for {b} hours. How many km does it drive?", Fraction(a * b), "word"
        )
    a, b, c = rng.randint(2, m), rng.randint(2, m), rng.randint(2, max(2, m // 4))
    return Problem(
        f"{name} reads {a} pages on Monday and {b} pages on Tuesday, then {c} times as many pages on Wednesday "
        "as on Monday. How many pages is that in all?",
        Fraction(a + b + c * a),
        "word",
    )


def generate_problem(seed: int, config: MathToolConfig) -> Problem:
    """The problem of ``seed`` under ``config``'s knobs: same (seed, knobs) -> same problem on every machine.

    The kind is drawn from ``kinds``; a draw that divides by zero, or has a non-integer answer while
    ``allow_fractions`` is off, is drawn again (at most ``MAX_GENERATION_ATTEMPTS`` times).
    """
    rng = random.Random(f"math-tool/{seed}")
    for _ in range(MAX_GENERATION_ATTEMPTS):
        kind = rng.choice(config.kinds)
        try:
            problem = _arithmetic(rng, config) if kind == "arithmetic" else _word(rng, config)
        except ZeroDivisionError:
            continue
        if config.allow_fractions or problem.answer.denominator == 1:
            return problem
    raise ValueError(
        f"no problem for seed {seed} after {MAX_GENERATION_ATTEMPTS} draws with allow_fractions=false; "
        "allow fractions or use fewer operations"
    )


def problem_of_task(task: Mapping[str, Any], config: MathToolConfig) -> Problem:
    """A task's problem: its explicit ``question``/``answer``, else the one generated from its ``seed``."""
    if task.get("question") is not None:
        answer = parse_number(str(task.get("answer", "")))
        if answer is None:
            raise ValueError(f"math-tool task {task.get('task_id', '?')!r}: 'answer' must be a number like 7 or 7/2")
        return Problem(str(task["question"]), answer)
    if task.get("seed") is not None:
        return generate_problem(int(task["seed"]), config)
    raise ValueError(f"math-tool task {task.get('task_id', '?')!r} needs a 'seed' or a 'question' and 'answer'")


def load_math_tool_tasks(num_tasks: int = DEFAULT_NUM_TASKS) -> list[dict[str, Any]]:
    """``num_tasks`` tasks, one seed each (0 .. num_tasks-1); ``humaneval.split_tasks`` holds out by hash."""
    if num_tasks < 2:
        raise ValueError(f"math-tool needs at least 2 tasks (one to train on, one held out), got {num_tasks}")
    return [{"task_id": f"math-tool/{seed}", "seed": seed} for seed in range(num_tasks)]


# --------------------------------------------------------------------------------------------------
# parsing: answers and programs
# --------------------------------------------------------------------------------------------------
_NUM = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_NUMBER = re.compile(rf"(?:{_NUM})(?:\s*/\s*(?:{_NUM}))?")
_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*(-?[\d.]+)\s*\}\s*\{\s*(-?[\d.]+)\s*\}")
_BOXED = re.compile(r"\\boxed\s*\{((?:[^{}]|\{[^{}]*\})*)\}")
_ANSWER = re.compile(r"(?:final\s+)?answer\s*(?:is)?\s*[:=]?\s*(.*)", re.IGNORECASE)
_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n?(.*?)(?:```|$)", re.DOTALL | re.IGNORECASE)


def _to_fraction(token: str) -> Fraction | None:
    token = token.replace(",", "").replace(" ", "")
    try:
        if "/" in token:
            num, den = token.split("/", 1)
            d = Fraction(den)
            return None if d == 0 else Fraction(num) / d
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def parse_number(text: str) -> Fraction | None:
    """The first number in ``text``: ``42``, ``-3``, ``42.0``, ``1,234``, ``7/2``, ``\\frac{7}{2}``; or None."""
    frac = _FRAC.search(text)
    plain = _NUMBER.search(text)
    if frac and (plain is None or frac.start() <= plain.start()):
        return _to_fraction(f"{frac.group(1)}/{frac.group(2)}")
    return _to_fraction(plain.group(0)) if plain else None


def _last_number(text: str) -> Fraction | None:
    fracs = list(_FRAC.finditer(text))
    inside = lambda m: any(f.start() <= m.start() < f.end() for f in fracs)  # noqa: E731
    found = fracs + [m for m in _NUMBER.finditer(text) if not inside(m)]
    if not found:
        return None
    return parse_number(text[max(found, key=lambda m: m.start()).start() :])


def parse_answer(text: str) -> Fraction | None:
    """The answer in a reply, most explicit form first: the last ``\\boxed{...}``; else the number after the last
    ``Answer:`` (``Final answer is``, ``answer =``); else the last number in the text. None: no answer."""
    boxed = _BOXED.findall(text)
    for inner in reversed(boxed):
        value = parse_number(inner)
        if value is not None:
            return value
    for line in reversed(text.splitlines()):
        m = _ANSWER.search(line)
        if m:
            value = parse_number(m.group(1))
            if value is not None:
                return value
    return _last_number(text)


def answers_match(value: Fraction | None, answer: Fraction) -> bool:
    """``value`` is the answer, up to float rounding (``REL_TOL``)."""
    return value is not None and abs(value - answer) <= REL_TOL * max(1, abs(answer))


def extract_program(text: str, max_chars: int) -> str | None:
    """The program in a reply: the first fenced block (```python ... ```, an unclosed fence runs to the end), else
    the whole reply when it calls ``print(``; None: no program (nothing runs). Cut to ``max_chars``."""
    for m in _FENCE.finditer(text):
        code = m.group(1).strip("\n")
        if code.strip():
            return code[:max_chars]
    if "print(" in text:
        return text.strip()[:max_chars]
    return None


def printed_value(stdout: str) -> Fraction | None:
    """What a program printed, as a number: the last number on its last non-empty line (None: none)."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    return _last_number(lines[-1]) if lines else None


# --------------------------------------------------------------------------------------------------
# rewards (docs/math-tool.md)
# --------------------------------------------------------------------------------------------------
def tool_reward(ran: bool, correct: bool, has_program: bool, config: MathToolConfig) -> float:
    """``r_tool = w * [ran cleanly] + (1 - w) * [printed the answer] - invalid_penalty * [no program]``."""
    if not has_program:
        return -config.invalid_penalty
    return config.ran_weight * float(ran) + (1.0 - config.ran_weight) * float(correct)


def reasoner_reward(correct: bool, has_answer: bool, config: MathToolConfig) -> float:
    """``r_reason = [answer right] - invalid_penalty * [no number in the reply]``."""
    return float(correct) - (0.0 if has_answer else config.invalid_penalty)


def team_reward(correct: bool) -> float:
    """1 when the reasoner's latest answer is right, else 0."""
    return 1.0 if correct else 0.0


# --------------------------------------------------------------------------------------------------
# state and env
# --------------------------------------------------------------------------------------------------
@dataclass
class ProgramRun:
    """One tool turn: the program (None: the reply held none), how it ended, what it printed (cut for prompts)."""

    program: str | None
    status: str  # "ok", "failed", "timeout", ... (ExecResult.status), or "no_program"
    stdout: str = ""
    error: str = ""  # the last line of stderr when it failed
    value: Fraction | None = None  # printed_value(stdout)


@dataclass
class MathToolState:
    """What both agents share. ``answer`` is hidden: for rewards only, prompts must not show it."""

    task_id: str
    question: str
    answer: Fraction  # hidden
    last_run: ProgramRun | None = None  # the tool's latest program and its output
    reasoner_answer: Fraction | None = None  # the reasoner's latest answer (None: none yet, or none parsed)
    reasoner_replied: bool = False
    runs: list[ProgramRun] = field(default_factory=list)
    answers: list[str | None] = field(default_factory=list)  # the reasoner's answers, as written

    @property
    def correct(self) -> bool:
        return answers_match(self.reasoner_answer, self.answer)


class MathToolEnv(Env):
    """Generated math problems for a tool agent and a reasoner (``math-tool``). See docs/math-tool.md."""

    Config = MathToolConfig
    config: MathToolConfig

    def __init__(
        self,
        task: Mapping[str, Any],
        config: MathToolConfig | Mapping[str, Any] | None = None,
        *,
        env_idx: int = 0,
        rollout_idx: int = 0,
        seed: int | None = None,
        sandbox: Sandbox | None = None,
    ) -> None:
        self._sandbox = sandbox
        super().__init__(task, config, env_idx=env_idx, rollout_idx=rollout_idx, seed=seed)

    @classmethod
    def validate_task(cls, task: Mapping[str, Any], config: EnvConfig) -> None:
        """The task's problem can be built (from ``question``/``answer`` or a ``seed``)."""
        key = "question" if task.get("question") is not None else "seed"
        try:
            problem_of_task(task, cls.validate_config(config))
        except (ValueError, TypeError) as exc:
            raise TaskDataError("answer" if key == "question" else key, str(exc)) from exc

    @classmethod
    def shared_resources(cls, config: EnvConfig) -> dict[str, Any]:
        """One sandbox for all episodes of this config (it owns the concurrency limit)."""
        from pettingflow.envs.sandbox import make_sandbox

        if not isinstance(config, MathToolConfig):
            raise TypeError(f"MathToolEnv needs a MathToolConfig, got {type(config).__name__}")
        return {"sandbox": make_sandbox(config.sandbox)}

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            self._sandbox = self.shared_resources(self.config)["sandbox"]
        return self._sandbox

    def initial_state(self) -> MathToolState:
        problem = problem_of_task(self.task, self.config)
        return MathToolState(str(self.task.get("task_id", "?")), problem.question, problem.answer)

    def solved(self) -> bool:
        return self.state.correct

    def fork(self) -> MathToolEnv:
        """Tree rollouts: the state (runs, answers) is copied; the sandbox is shared."""
        return self._copy_episode()

    async def run_program(self, program: str | None) -> TurnOutcome:
        """The tool's turn: run ``program`` in the sandbox and store its output for the reasoner.

        Reward: ``tool_reward``; success: it ran cleanly and its last printed number is the answer. A
        sandbox infrastructure error propagates (it is not the model's failure)."""
        s = self.state
        if program is None:
            run = ProgramRun(None, "no_program")
        else:
            result: ExecResult = await self.sandbox.run_async(program)
            stdout = result.stdout.strip()
            error = ""
            if not result.passed:
                tail = [line for line in result.stderr.splitlines() if line.strip()]
                error = tail[-1].strip()[:SHOWN_OUTPUT_CHARS] if tail else result.status
            value = printed_value(stdout) if result.passed else None
            run = ProgramRun(program, result.status, stdout[-SHOWN_OUTPUT_CHARS:], error, value)
        s.last_run = run
        s.runs.append(run)
        ran = run.status == "ok"
        correct = ran and answers_match(run.value, s.answer)
        reward = tool_reward(ran, correct, program is not None, self.config)
        info = {
            "role": "tool",
            "invalid": program is None,
            "status": run.status,
            "printed": None if run.value is None else format_number(run.value),
            "ran": ran,
            "correct": correct,
            "local_reward": reward,
        }
        return TurnOutcome(reward, correct, info)

    def submit_answer(self, answer: Fraction | None) -> TurnOutcome:
        """The reasoner's turn: record its answer. Reward: ``reasoner_reward``; success: the answer is right
        (which ends the episode)."""
        s = self.state
        s.reasoner_answer = answer
        s.reasoner_replied = True
        s.answers.append(None if answer is None else format_number(answer))
        correct = s.correct
        reward = reasoner_reward(correct, answer is not None, self.config)
        tool_value = s.last_run.value if s.last_run is not None else None
        info = {
            "role": "reasoner",
            "invalid": answer is None,
            "answer": None if answer is None else format_number(answer),
            "correct": correct,
            "agrees_with_tool": answer is not None and tool_value is not None and answers_match(answer, tool_value),
            "local_reward": reward,
        }
        return TurnOutcome(reward, correct, info)

    def team_outcome(self) -> float:
        """The team reward if the episode ended now: 1.0 when the reasoner's latest answer is right, else 0.0.
        Tree rollouts credit each candidate with this value on its own fork."""
        return team_reward(self.state.correct)

    def episode_info(self) -> dict[str, Any]:
        """Per-episode values every row of the episode carries (``info_json``): the team reward and the problem."""
        s = self.state
        return {
            "team_reward": self.team_outcome(),
            "solved": s.correct,
            "question": s.question,
            "answer": format_number(s.answer),
            "final_answer": s.answers[-1] if s.answers else None,
            "tool_correct": any(r.status == "ok" and answers_match(r.value, s.answer) for r in s.runs),
        }
