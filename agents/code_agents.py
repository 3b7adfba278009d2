"""The two agents of ``code-env``: a code generator and a unit-test generator.

Prompts are short and concrete because the default model is SmolLM2-135M-Instruct: the problem
is shown as code (signature + docstring), the answer format is one ```python block, and feedback is
a short list of failing asserts with their errors. Parsing is forgiving (a missing closing fence, no
fence at all, prose around code) because a malformed reply should earn a low reward, not crash the
rollout. Ground-truth tests and the canonical solution never appear in a prompt.
"""

from __future__ import annotations

import ast
import re

from pettingflow.agents.base import Agent
from pettingflow.envs.base import Env
from pettingflow.envs.code_env import (
    CodeEnv,
    CodeEnvState,
    UnitTestReward,
    code_reward,
    code_success,
    unit_test_reward,
)

MAX_FEEDBACK_ITEMS = 5
_PYTHON_TAGS = {"python", "py", "python3"}
_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_CODE_START = re.compile(r"^(def |async def |class |import |from |@)", re.MULTILINE)


# --------------------------------------------------------------------------------------------------
# parsing
# --------------------------------------------------------------------------------------------------
def _blocks(text: str) -> list[tuple[str, str]]:
    """(language tag, content) of every fenced block; an unclosed last fence runs to the end."""
    return [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]


def _compiles(code: str) -> bool:
    try:
        compile(code, "<response>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True


def extract_code(text: str) -> str:
    """The code in a reply: the last ```python block, else the last fenced block, else the text itself.

    Without fences, leading prose is cut at the first line that starts code (``def``, ``import``, ...)
    and trailing prose lines are dropped until the code compiles.
    """
    blocks = _blocks(text)
    if blocks:
        tagged = [body for tag, body in blocks if tag in _PYTHON_TAGS]
        return (tagged or [body for _, body in blocks])[-1].strip("\n")
    code = text.strip("\n")
    if _compiles(code):
        return code
    start = _CODE_START.search(code)
    if start is None:
        return code
    lines = code[start.start() :].splitlines()
    for end in range(len(lines), 0, -1):
        candidate = "\n".join(lines[:end])
        if _compiles(candidate):
            return candidate
    return "\n".join(lines)


def _calls(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name for n in ast.walk(node))


def _asserts_in(source: str, entry_point: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        found = []
        for line in source.splitlines():
            stripped = line.strip()
            if stripped.startswith("assert"):
                try:
                    found.extend(_asserts_in_tree(ast.parse(stripped), entry_point))
                except SyntaxError:
                    continue
        return found
    return _asserts_in_tree(tree, entry_point)


def _asserts_in_tree(tree: ast.AST, entry_point: str) -> list[str]:
    return [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Assert) and _calls(n.test, entry_point)]


def extract_asserts(text: str, entry_point: str) -> list[str]:
    """Assert statements that call ``entry_point``, in order, without duplicates.

    Looks in every fenced block (or the whole text when there is none); a block that does not parse
    is read line by line. Asserts that do not call the function (``assert True``) are dropped: they
    test nothing and would be free reward.
    """
    chunks = [body for _, body in _blocks(text)] or [text]
    seen: dict[str, None] = {}
    for chunk in chunks:
        for stmt in _asserts_in(chunk, entry_point):
            seen.setdefault(stmt, None)
    return list(seen)


def complete_solution(code: str, problem: str, entry_point: str) -> str:
    """``code`` as a full program: when it does not define ``entry_point`` but reads as the function
    body (the model continued the prompt), prepend the prompt."""
    if re.search(rf"^\s*(async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, flags=re.MULTILINE):
        return code
    joined = problem.rstrip("\n") + "\n" + code
    return joined if code.strip() and _compiles(joined) else code


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def code_env(env: Env) -> CodeEnv:
    """``env`` as a ``CodeEnv`` (a clear error if an agent was paired with the wrong env)."""
    if not isinstance(env, CodeEnv) or not isinstance(env.state, CodeEnvState):
        raise TypeError(f"code agents need a CodeEnv with a CodeEnvState, got {env!r}")
    return env


def code_state(env: Env) -> CodeEnvState:
    return code_env(env).state


def _fenced(code: str) -> str:
    return f"```python\n{code.strip()}\n```"


def _failures(state: CodeEnvState) -> str:
    """The failing generated tests on the latest code, at most ``MAX_FEEDBACK_ITEMS``."""
    failing = state.mismatch_cases
    lines = [f"- `{c.source}` -> {c.error or 'failed'}" for c in failing[:MAX_FEEDBACK_ITEMS]]
    if len(failing) > MAX_FEEDBACK_ITEMS:
        lines.append(f"- ... and {len(failing) - MAX_FEEDBACK_ITEMS} more")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# agents
# --------------------------------------------------------------------------------------------------
class CodeGeneratorAgent(Agent):
    """Writes the function (``code-generator``). Reward: share of ground-truth cases passed."""

    default_name = "code_generator"
    decides_outcome = True  # the episode succeeds when the code it last submitted passes
    system_prompt = (
        "You are a careful Python programmer. Answer with one complete Python function in a ```python block."
    )

    def turn_prompt(self, env: Env) -> str:
        s = code_state(env)
        parts = [f"Write the Python function `{s.entry_point}` described below.", _fenced(s.problem)]
        if s.generated_code is not None:
            parts += ["Your previous code:", _fenced(s.generated_code), self._feedback(s)]
        parts.append(self._instruction(s))
        return "\n\n".join(parts)

    def observation(self, env: Env) -> str:
        s = code_state(env)
        parts = []
        if s.generated_tests:
            parts += ["Tests were written for your code:", _fenced("\n".join(s.generated_tests))]
        parts += [self._feedback(s), self._instruction(s)]
        return "\n\n".join(parts)

    @staticmethod
    def _feedback(s: CodeEnvState) -> str:
        if s.mismatch_cases:
            return f"It fails these tests:\n{_failures(s)}\nFix the code."
        if s.generated_test_results:
            return "It passes the tests written so far, but it may still be wrong. Check it against the description."
        return "Check it against the description and fix any mistakes."

    @staticmethod
    def _instruction(s: CodeEnvState) -> str:
        return f"Reply with the complete function `{s.entry_point}` in one ```python block."

    def parse_response(self, response_text: str, env: Env) -> str:
        s = code_state(env)
        return complete_solution(extract_code(response_text), s.problem, s.entry_point)

    async def apply_action(self, env: Env) -> tuple[float, bool]:
        evaluation = await code_env(env).submit_code(self.current_action)
        reward = code_reward(evaluation.ground_truth)
        # the local reward of this turn and its parts: the row's info_json["turn"] (docs/code-env.md)
        self.turn_info = {
            "role": "code",
            "local_reward": reward,
            "ground_truth_passed": evaluation.ground_truth.passed,
            "ground_truth_cases": evaluation.ground_truth.total,
            "sandbox": evaluation.ground_truth.digest(),
        }
        return reward, code_success(evaluation.ground_truth)


class UnitTestGeneratorAgent(Agent):
    """Writes asserts (``unit-test-generator``). Reward: ``unit_test_reward`` (docs/code-env.md)."""

    default_name = "test_generator"
    system_prompt = "You are a careful Python tester. Answer with assert statements in one ```python block."

    def turn_prompt(self, env: Env) -> str:
        s = code_state(env)
        parts = [f"Write tests for the Python function `{s.entry_point}` described below.", _fenced(s.problem)]
        if s.generated_code is not None:
            parts += ["Someone wrote this code for it. It may have bugs:", _fenced(s.generated_code)]
        if s.generated_tests:
            parts += ["Your previous tests:", _fenced("\n".join(s.generated_tests))]
        parts.append(self._instruction(s))
        return "\n\n".join(parts)

    def observation(self, env: Env) -> str:
        s = code_state(env)
        parts = []
        if s.generated_code is not None:
            parts += ["The code was updated:", _fenced(s.generated_code)]
        if s.generated_test_results:
            passed = sum(c.passed for c in s.generated_test_results)
            parts.append(f"{passed} of {len(s.generated_test_results)} of your tests pass on it.")
        parts.append(self._instruction(s))
        return "\n\n".join(parts)

    @staticmethod
    def _instruction(s: CodeEnvState) -> str:
        return (
            f"Write 3 to 5 lines like `assert {s.entry_point}(...) == ...`, each with literal inputs and the "
            "literal correct output that follow the description, so that buggy code fails. Reply with the "
            "asserts in one ```python block."
        )

    def parse_response(self, response_text: str, env: Env) -> list[str]:
        return extract_asserts(response_text, code_state(env).entry_point)

    def reset(self) -> None:
        super().reset()
        self.last_reward_parts: UnitTestReward | None = None

    async def apply_action(self, env: Env) -> tuple[float, bool]:
        cenv = code_env(env)
        evaluation = await cenv.submit_tests(self.current_action)
        result = unit_test_reward(
            evaluation.on_golden.flags(),
            evaluation.on_code.flags() if evaluation.on_code is not None else None,
            evaluation.code_ground_truth_ratio,
            cenv.config.catch_bonus_weight,
        )
        self.last_reward_parts = result
        self.turn_info = {
            "role": "test",
            "local_reward": result.reward,
            "asserts": evaluation.on_golden.total,
            "validity": result.validity,
            "caught": result.caught,
            "bonus_applies": result.bonus_applies,
            "sandbox": evaluation.on_golden.digest(),
        }
        return result.reward, result.success
