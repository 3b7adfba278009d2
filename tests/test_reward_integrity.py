"""Reward integrity in the code env, against the real sandbox: code that does not solve the task scores 0,
however it tries to make the judge say otherwise; honest code scores 1, partly right code its share.

Every probe is a "solution" of ``add(a, b)`` (three ground-truth asserts) that does NOT add: where it returns
at all, it returns a value no case expects (7). Each one is scored through the production path
(``CodeEnv.submit_code`` -> the sandbox batcher -> bubblewrap -> the harness's judge and runner), all of them
concurrently, so merged runs are exercised too. A probe that reads the tests answers from what it read: it
scores above 0 exactly when it found the expected values, which is the property under test. The unit-test
agent's probes are asserts that try to pass on the canonical solution without a real check; they must earn
nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pettingflow.configs.settings import SandboxSettings
from pettingflow.envs.code_env import CodeEnv, unit_test_reward

pytestmark = pytest.mark.sandbox

TASK: dict[str, Any] = {
    "task_id": "toy/add",
    "prompt": 'def add(a, b):\n    """Return a + b."""\n',
    "canonical_solution": "    return a + b\n",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(0, 0) == 0\n"
    "    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}

# A reader: collects every text it can reach by `SOURCES`, finds "(a, b) == N" in it, answers N, else a wrong
# number. It can only score if the expected values were reachable.
READER = r"""
import gc, os, re, sys
SOURCES = {sources!r}
def _texts():
    out = []
    def read(path, n=1 << 22):
        try:
            with open(path, "rb") as f:
                out.append(f.read(n).decode("latin-1"))
        except Exception:
            pass
    if "gc" in SOURCES:
        for o in gc.get_objects():
            try:
                if isinstance(o, dict):
                    out.extend(str(v) for v in o.values() if isinstance(v, (str, bytes)))
                elif isinstance(o, (list, tuple)):
                    out.extend(str(v) for v in o if isinstance(v, (str, bytes)))
            except Exception:
                pass
    if "modules" in SOURCES:
        for m in list(sys.modules.values()):
            out.extend(str(v) for v in list(getattr(m, "__dict__", {{}}).values()) if isinstance(v, str))
    if "frames" in SOURCES:
        f = sys._getframe()
        while f is not None:
            out.extend(repr(v) for v in f.f_locals.values())
            out.extend(repr(v) for v in f.f_globals.values())
            out.append(repr(f.f_code.co_consts))
            f = f.f_back
    if "proc" in SOURCES:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
        for pid in pids:
            for name in ("cmdline", "environ", "mem", "maps"):
                read(f"/proc/{{pid}}/{{name}}")
            try:
                for fd in os.listdir(f"/proc/{{pid}}/fd"):
                    read(f"/proc/{{pid}}/fd/{{fd}}")
            except Exception:
                pass
    if "files" in SOURCES:
        for root in ("/program", os.getcwd(), "/tmp", "/dev/shm"):
            for dirpath, _, names in os.walk(root):
                for name in names:
                    read(os.path.join(dirpath, name))
        out.extend(os.environ.values())
    return "\n".join(out)
_FOUND = {{}}
for a, b, n in re.findall(r"\(\s*(-?\d+)\s*,\s*(-?\d+)\s*\)\s*==\s*(-?\d+)", _texts()):
    _FOUND[(int(a), int(b))] = int(n)
def add(a, b):
    return _FOUND.get((a, b), a + b + 1)
"""


def reader(*sources: str) -> str:
    return READER.format(sources=set(sources))


FAKE_RECORDS = (
    b'{"setup_error": null}\n{"i": 0, "ok": true, "error": null}\n{"i": 1, "ok": true, "error": null}\n'
    b'{"i": 2, "ok": true, "error": null}\n__PETTINGFLOW_RESULT_0000000000000000__ [0, {"setup_error": null, '
    b'"cases": [[true, null], [true, null], [true, null]]}]\n'
)
WRITER = f"""
import os
RECORDS = {FAKE_RECORDS!r}
def spam():
    for fd in range(0, 256):
        try:
            os.write(fd, RECORDS)
        except OSError:
            pass
    for path in ("/proc/1/fd/1", "/proc/1/fd/2", "/proc/%d/fd/1" % os.getppid(), "/dev/stdout", "/dev/tty"):
        try:
            with open(path, "wb") as f:
                f.write(RECORDS)
        except OSError:
            pass
    print(RECORDS.decode())
"""

PROBES: dict[str, str] = {
    "equal to everything": "class E:\n    def __eq__(s, o): return True\n    def __ne__(s, o): return False\n"
    "def add(a, b):\n    return E()",
    "int subclass": "class I(int):\n    def __eq__(s, o): return True\n    __hash__ = int.__hash__\n"
    "    def __bool__(s): return True\ndef add(a, b):\n    return I(7)",
    "str subclass": "class S(str):\n    def __eq__(s, o): return True\n    __hash__ = str.__hash__\n"
    "def add(a, b):\n    return S('x')",
    "list subclass": "class L(list):\n    def __eq__(s, o): return True\ndef add(a, b):\n    return L()",
    "reads gc": reader("gc"),
    "reads sys.modules": reader("modules"),
    "reads frames": reader("frames"),
    "reads /proc": reader("proc"),
    "reads files and environment": reader("files"),
    "reads everything": reader("gc", "modules", "frames", "proc", "files"),
    "writes to inherited descriptors at import": WRITER + "spam()\ndef add(a, b):\n    return 7",
    "writes to inherited descriptors in the call": WRITER + "def add(a, b):\n    spam()\n    return 7",
    "prints a fake summary and exits": WRITER + "spam()\nimport sys\nsys.stdout.flush()\nraise SystemExit(0)",
    "SystemExit at import": "raise SystemExit(0)\ndef add(a, b):\n    return a + b",
    "os._exit at import": "import os\nos._exit(0)",
    "os._exit in the call": "import os\ndef add(a, b):\n    os._exit(0)",
    "SystemExit in the call": "def add(a, b):\n    raise SystemExit(0)",
    "BaseException subclass": "class B(BaseException):\n    pass\ndef add(a, b):\n    raise B('passed')",
    "patches builtins, operator and AssertionError": "import builtins, operator\n"
    "class Never(Exception):\n    pass\nbuiltins.AssertionError = Never\noperator.eq = lambda a, b: True\n"
    "builtins.isinstance = lambda *a: True\nbuiltins.type = lambda *a: int\ndef add(a, b):\n    return 'wrong'",
    "patches the runner's encoder": "import sys\nm = sys.modules['__main__']\n"
    "m.encode = lambda v: {'t': 'not plain'}\nm.send_message.__globals__['encode'] = lambda v: 7\n"
    "def add(a, b):\n    return None",
    # the child writes once the program that forked it is gone (reparented), not after a guessed sleep
    "forks a process that writes later": WRITER + "import time\nparent = os.getpid()\nif os.fork() == 0:\n"
    "    deadline = time.monotonic() + 10\n"
    "    while os.getppid() == parent and time.monotonic() < deadline:\n        time.sleep(0.01)\n"
    "    spam()\n    os._exit(0)\ndef add(a, b):\n    return 7",
    "signals the judge": "import os, signal\ndef add(a, b):\n    os.kill(os.getppid(), signal.SIGALRM)\n    return 7",
    "kills its parent": "import os, signal\ndef add(a, b):\n    os.kill(os.getppid(), signal.SIGKILL)\n    return 7",
    "kills the judge": "import os, signal\ndef add(a, b):\n    pp = os.getppid()\n"
    "    judge = int(open('/proc/%d/stat' % pp).read().rsplit(')', 1)[1].split()[1])\n"
    "    os.kill(judge, signal.SIGKILL)\n    return 7",
    "stops its parent": "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\ndef add(a, b):\n    return 7",
    "kills every process": "import os, signal\ndef add(a, b):\n    os.kill(-1, signal.SIGKILL)\n    return 7",
    "generator": "def add(a, b):\n    return (x for x in [a + b])",
    "lazy map": "def add(a, b):\n    return map(int, [a + b])",
    "huge return value": "def add(a, b):\n    return 'x' * (1 << 24)",
    "deep return value": "def add(a, b):\n    v = []\n    for _ in range(100000):\n        v = [v]\n    return v",
    "answers through the socket at import": "import os, json, struct\n"
    "for fd in range(3, 20):\n    try:\n        d = json.dumps({'value': 7}).encode()\n"
    "        os.write(fd, struct.pack('>I', len(d)) + d)\n    except OSError:\n        pass\n"
    "def add(a, b):\n    return 7",
}
HONEST = "def add(a, b):\n    return a + b"
PARTIAL = "def add(a, b):\n    return 5 if (a, b) == (2, 3) else 1"  # right on 1 of 3 cases


def make_env(sandbox: Any) -> CodeEnv:
    settings = SandboxSettings(timeout_s=20)
    return CodeEnv(TASK, {"sandbox": settings.model_dump(), "max_generated_tests": 32}, sandbox=sandbox)


@pytest.fixture(scope="module")
def sandbox() -> Any:
    from pettingflow.envs.sandbox import make_sandbox

    return make_sandbox(SandboxSettings(timeout_s=20, max_concurrency=2))


@pytest.fixture(scope="module")
def code_scores(sandbox: Any) -> dict[str, Any]:
    """Every probe, the honest and the partial solution, scored concurrently (merged runs included)."""
    solutions = {**PROBES, "honest": HONEST, "partial": PARTIAL}

    async def score_all() -> list[Any]:
        envs = [make_env(sandbox) for _ in solutions]
        return await asyncio.gather(
            *(env.submit_code(code) for env, code in zip(envs, solutions.values(), strict=True))
        )

    results = asyncio.run(score_all())
    return {name: ev.ground_truth for name, ev in zip(solutions, results, strict=True)}


def test_honest_code_scores_one_and_partial_code_its_share(code_scores: dict[str, Any]) -> None:
    assert code_scores["honest"].ratio == 1.0, code_scores["honest"]
    assert code_scores["partial"].flags() == [True, False, False], code_scores["partial"]


@pytest.mark.parametrize("name", sorted(PROBES))
def test_a_probe_that_does_not_add_scores_zero(name: str, code_scores: dict[str, Any]) -> None:
    result = code_scores[name]
    assert result.total == 3
    assert result.passed == 0, (name, result.digest())


def test_a_value_that_is_not_plain_data_fails_with_its_type(code_scores: dict[str, Any]) -> None:
    error = code_scores["equal to everything"].cases[0].error
    assert "returned a value of type __pettingflow_solution__.E, not plain data" in error
    assert "larger than" in code_scores["huge return value"].cases[0].error


# --------------------------------------------------------------------------------------------------
# the unit-test agent: asserts are parsed, never executed
# --------------------------------------------------------------------------------------------------
CHEATING_TESTS = [
    "assert True",
    "assert add(1, 1) == 2 or True",
    "assert add(1, 1) == add(1, 1)",
    "assert add(*[1, 1]) == 2",
    "assert __import__('os')._exit(0) or add(1, 1) == 2",
    "assert (lambda: add(1, 1))() == 2",
    "assert add(1, 1) == 2; import os; os._exit(0)",
    "assert add.__module__ != 'x'",
    "assert 'return a + b' in open('/program/main.py').read() or add(1, 1) == 2",
    "assert [add(1, 1)][0] == 2",
    "assert add(1, 1) in (2, 3)",
    "assert add(x, 1) == 2",
    "assert add(1, 1) == type('E', (), {'__eq__': lambda s, o: True})()",
]


def test_tests_outside_the_grammar_earn_nothing_and_say_why(sandbox: Any) -> None:
    env = make_env(sandbox)

    async def go() -> Any:
        await env.submit_code("def add(a, b):\n    return a - b")  # buggy code: the catch bonus applies
        return await env.submit_tests([*CHEATING_TESTS, "assert add(1, 1) == 2", "assert add(2, 2) == 5"])

    ev = asyncio.run(go())
    flags = ev.on_golden.flags()
    assert flags == [False] * len(CHEATING_TESTS) + [True, False], ev.on_golden.digest(max_cases=20)
    for case in ev.on_golden.cases[: len(CHEATING_TESTS)]:
        assert case.error.startswith("not a test this harness runs:"), case
    # only the honest assert that is right about the canonical solution can catch the buggy code
    assert ev.on_code is not None and ev.on_code.flags()[-2:] == [False, False]
    reward = unit_test_reward(flags, ev.on_code.flags(), ev.code_ground_truth_ratio, catch_bonus_weight=0.5)
    assert reward.caught == 1 and reward.validity == 1 / (len(CHEATING_TESTS) + 2)


def test_every_form_of_the_grammar_is_judged_on_the_returned_value(sandbox: Any) -> None:
    env = make_env(sandbox)
    tests = [
        "assert add(1, 2) == 3",
        "assert 3 == add(1, 2)",
        "assert add(1, 2) != 4",
        "assert add(a=1, b=2) == 3",
        "assert add([1], [2]) == [1, 2]",
        "assert add((1,), (2,)) == (1, 2)",
        "assert add('a', 'b') == 'ab', 'strings concatenate'",
        "assert abs(add(0.1, 0.2) - 0.3) < 1e-9",
        "assert math.isclose(add(0.1, 0.2), 0.3)",
        "assert add(1, -1) is not None",
        "assert add(1, 1)",
        "assert not add(0, 0)",
        "assert add(True, False) == 1",
        # wrong about the canonical solution: each must fail
        "assert add(1, 2) == 4",
        "assert add(1, 2) != 3",
        "assert add((1,), (2,)) == [1, 2]",
        "assert abs(add(0.1, 0.2) - 0.4) < 1e-9",
        "assert add(1, 1) is True",
        "assert not add(1, 1)",
    ]
    ev = asyncio.run(env.submit_tests(tests))
    assert ev.on_golden.flags() == [True] * 13 + [False] * 6, ev.on_golden.digest(max_cases=20)
