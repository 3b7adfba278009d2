"""The agents of ``math-tool``: a tool agent that writes a Python program for the problem (run in the sandbox by
the env) and a reasoner that reads the problem and the program's output and answers.

Prompts are short because the default model is SmolLM2-135M-Instruct: the problem, what the latest program
printed (or how it failed), and one line saying what to reply. Neither agent sees the other's reply text
directly: the program's output and the latest answer live in ``env.state``. Parsing is forgiving
(``envs.math_tool.extract_program`` / ``parse_answer``); a reply without a program or a number is an invalid
turn, not an error.
"""

from __future__ import annotations

from collections.abc import Awaitable
from fractions import Fraction

from pettingflow.agents.base import EnvActionAgent
from pettingflow.envs.base import Env, TurnOutcome
from pettingflow.envs.math_tool import (
    MathToolEnv,
    MathToolState,
    ProgramRun,
    extract_program,
    format_number,
    parse_answer,
)

TOOL_PREFIX = "```python\nprint("
REASONER_PREFIX = "Answer:"


def math_env(env: Env) -> MathToolEnv:
    """``env`` as a ``MathToolEnv`` (a clear error if an agent was paired with the wrong env)."""
    if not isinstance(env, MathToolEnv) or not isinstance(env.state, MathToolState):
        raise TypeError(f"math-tool agents need a MathToolEnv with a MathToolState, got {env!r}")
    return env


def describe_run(run: ProgramRun | None) -> str:
    """What the tool's latest program did, as both agents are told."""
    if run is None:
        return "No program has run yet."
    if run.status == "no_program":
        return "The tool's last reply held no program, so nothing ran."
    if run.status == "ok":
        return f"The program printed:\n{run.stdout}" if run.stdout else "The program ran but printed nothing."
    if run.status == "timeout":
        return "The program was stopped: it ran out of time."
    return f"The program failed: {run.error or run.status}"


def turns_left(env: Env) -> str:
    return f"Turns left for the team: {env.max_turns - env.current_turn}."


class ToolAgent(EnvActionAgent):
    """Writes a Python program that prints the answer (``math-tool-tool``). Reward: it ran and printed the answer."""

    default_name = "tool"
    system_prompt = "You write short Python programs that solve math problems and print the answer."

    def answer_prefix(self, env: Env) -> str:
        return TOOL_PREFIX if math_env(env).config.answer_prefix else ""

    def turn_prompt(self, env: Env) -> str:
        s = math_env(env).state
        parts = [f"Problem: {s.question}"]
        if s.last_run is not None:
            parts.append(describe_run(s.last_run))
        if s.answers:
            parts.append(f"The reasoner answered: {s.answers[-1] or '(no number)'}, which was not accepted.")
        parts += [
            turns_left(env),
            "Write a short Python program that computes the answer from the numbers of the problem and prints it, "
            "in a ```python block.",
        ]
        return "\n".join(parts)

    def parse_response(self, response_text: str, env: Env) -> str | None:
        """The program in the reply; a reply that opens its own fence after the prefilled one is read alone."""
        reply = response_text.removeprefix(TOOL_PREFIX)
        if reply is not response_text and reply.lstrip().startswith("```"):
            response_text = reply.lstrip()
        return extract_program(response_text, math_env(env).config.max_program_chars)

    def submit(self, env: Env) -> Awaitable[TurnOutcome]:
        return math_env(env).run_program(self.current_action)


class ReasonerAgent(EnvActionAgent):
    """Reads the problem and the program's output and answers (``math-tool-reasoner``). Reward: the answer is right."""

    default_name = "reasoner"
    decides_outcome = True  # its answer is the team's
    system_prompt = "You solve math problems. A partner runs Python code for you; you give the final answer."

    def answer_prefix(self, env: Env) -> str:
        return REASONER_PREFIX if math_env(env).config.answer_prefix else ""

    def turn_prompt(self, env: Env) -> str:
        s = math_env(env).state
        parts = [f"Problem: {s.question}", describe_run(s.last_run)]
        if s.answers:
            parts.append(f"Your last answer, {s.answers[-1] or '(no number)'}, was not accepted.")
        parts += [
            turns_left(env),
            "Check the program's output against the problem; if it is right, repeat it as the final answer. "
            "Reply with one line: Answer: followed by the number.",
        ]
        return "\n".join(parts)

    def parse_response(self, response_text: str, env: Env) -> Fraction | None:
        return parse_answer(response_text)

    def submit(self, env: Env) -> TurnOutcome:
        return math_env(env).submit_answer(self.current_action)


__all__ = ["REASONER_PREFIX", "TOOL_PREFIX", "ReasonerAgent", "ToolAgent", "describe_run", "format_number"]
