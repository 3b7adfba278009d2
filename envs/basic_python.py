"""``basic-python``: 100 short, HumanEval-shaped function tasks a 135M-parameter model can partly solve.

Why this exists: SmolLM2-135M-Instruct solves almost no HumanEval problem (reward ≈ 0 in every
iteration of the default run), so GRPO gets no signal from it and a learning curve on HumanEval
would show nothing but noise. These tasks keep HumanEval's shape (signature + docstring with one
example, ``check(candidate)`` asserts, an entry point) and the same code env, rewards and sandbox,
but each asks for one line of Python. Twenty families (add a constant, count a letter, keep the
items above a bound, ...) times five constants give 100 tasks with distinct names and answers.

Held-out tasks come from the same families with other constants (the hash split in
``humaneval.split_tasks`` decides), so a rising held-out score means the policy got better at this
kind of task, not that it can now write arbitrary code. ``docs/results.md`` says so next to the numbers.

The set is generated, not shipped as a file, so it is the same on every machine and a test checks
that every canonical solution passes its own asserts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten"}
_SEPARATORS = {"-": "dash", "+": "plus", ", ": "comma", "_": "underscore", "/": "slash"}


@dataclass(frozen=True)
class _Family:
    """One kind of task; ``make(param)`` returns (name, args, doc, body, example, cases)."""

    key: str
    params: tuple[Any, ...]
    make: Callable[[Any], tuple[str, str, str, str, tuple[str, str], list[tuple[str, str]]]]


def _num(k: int) -> str:
    return _WORDS[k]


def _families() -> list[_Family]:
    fams: list[_Family] = []

    def add(key: str, params: tuple[Any, ...]):
        def deco(fn):
            fams.append(_Family(key, params, fn))
            return fn

        return deco

    @add("add", (2, 3, 5, 7, 10))
    def _(k):
        return (
            f"add_{_num(k)}", "x: int", f"Return x plus {k}.", f"return x + {k}",
            ("4", repr(4 + k)), [(a, repr(int(a) + k)) for a in ("0", "1", "-3", "100")],
        )  # fmt: skip

    @add("times", (2, 3, 4, 6, 9))
    def _(k):
        return (
            f"times_{_num(k)}", "x: int", f"Return x multiplied by {k}.", f"return x * {k}",
            ("5", repr(5 * k)), [(a, repr(int(a) * k)) for a in ("0", "1", "-2", "11")],
        )  # fmt: skip

    @add("divisible", (2, 3, 5, 7, 9))
    def _(k):
        return (
            f"is_divisible_by_{_num(k)}", "n: int", f"Return True if n is divisible by {k}, else False.",
            f"return n % {k} == 0", (repr(2 * k), "True"),
            [(repr(a), repr(a % k == 0)) for a in (0, k, k + 1, 3 * k, 3 * k - 1)],
        )  # fmt: skip

    @add("power", (2, 3, 4, 5, 6))
    def _(k):
        return (
            f"power_{_num(k)}", "x: int", f"Return x raised to the power {k}.", f"return x ** {k}",
            ("2", repr(2**k)), [(a, repr(int(a) ** k)) for a in ("0", "1", "3", "-2")],
        )  # fmt: skip

    @add("repeat", (2, 3, 4, 5, 6))
    def _(k):
        return (
            f"repeat_{_num(k)}_times", "s: str", f"Return the string s repeated {k} times.", f"return s * {k}",
            ("'ab'", repr("ab" * k)), [(repr(a), repr(a * k)) for a in ("x", "", "hi!", "abc")],
        )  # fmt: skip

    @add("first", (2, 3, 4, 5, 6))
    def _(k):
        return (
            f"first_{_num(k)}", "items: list", f"Return a list of the first {k} items (all items if there are fewer).",
            f"return items[:{k}]", (repr(list(range(1, k + 3))), repr(list(range(1, k + 1)))),
            [(repr(a), repr(a[:k])) for a in ([], [9], list(range(10, 20)), list("abcdefgh"))],
        )  # fmt: skip

    @add("last", (2, 3, 4, 5, 6))
    def _(k):
        return (
            f"last_{_num(k)}", "items: list", f"Return a list of the last {k} items (all items if there are fewer).",
            f"return items[-{k}:]", (repr(list(range(1, k + 3))), repr(list(range(3, k + 3)))),
            [(repr(a), repr(a[-k:])) for a in ([], [9], list(range(10, 20)), list("abcdefgh"))],
        )  # fmt: skip

    @add("count_above", (0, 2, 5, 10, 50))
    def _(k):
        cases = ([], [k], [k + 1, k - 1, k + 5], list(range(k - 3, k + 4)), [100, -100, 0])
        return (
            f"count_above_{k}", "nums: list", f"Return how many numbers in nums are greater than {k}.",
            f"return sum(1 for n in nums if n > {k})", (repr([k - 1, k + 1, k + 2]), "2"),
            [(repr(a), repr(sum(1 for n in a if n > k))) for a in cases],
        )  # fmt: skip

    @add("keep_above", (0, 3, 10, 20, 100))
    def _(k):
        cases = ([], [k], [k + 1, k - 1, k + 5], list(range(k - 3, k + 4)), [1000, -1000])
        return (
            f"keep_above_{k}", "nums: list", f"Return the numbers in nums that are greater than {k}, in order.",
            f"return [n for n in nums if n > {k}]", (repr([k + 2, k - 1, k + 1]), repr([k + 2, k + 1])),
            [(repr(a), repr([n for n in a if n > k])) for a in cases],
        )  # fmt: skip

    @add("add_each", (1, 2, 3, 5, 10))
    def _(k):
        cases = ([], [0], [1, 2, 3], [-5, 5, 100])
        return (
            f"add_{k}_to_each", "nums: list", f"Return a new list with {k} added to every number in nums.",
            f"return [n + {k} for n in nums]", ("[1, 2]", repr([1 + k, 2 + k])),
            [(repr(a), repr([n + k for n in a])) for a in cases],
        )  # fmt: skip

    @add("cap", (0, 5, 10, 50, 100))
    def _(k):
        return (
            f"cap_at_{k}", "x: int", f"Return x, but never more than {k}: values above {k} become {k}.",
            f"return min(x, {k})", (repr(k + 7), repr(k)), [(repr(a), repr(min(a, k))) for a in (k - 4, k, k + 1, -99)],
        )  # fmt: skip

    @add("count_letter", ("a", "e", "o", "s", "t"))
    def _(c):
        cases = ("", c, c * 3, f"x{c}y{c}z", "bcdfg" if c not in "bcdfg" else "aeiou")
        return (
            f"count_letter_{c}", "s: str", f"Return how many times the letter '{c}' appears in s.",
            f"return s.count({c!r})", (repr(f"{c}b{c}"), "2"), [(repr(a), repr(a.count(c))) for a in cases],
        )  # fmt: skip

    @add("starts", ("a", "b", "x", "#", "Q"))
    def _(c):
        cases = ("", c, f"{c}bc", f"z{c}", c.lower() + "A" if c.isupper() else c.upper() + "a")
        return (
            f"starts_with_{_name(c)}", "s: str", f"Return True if the string s starts with '{c}', else False.",
            f"return s.startswith({c!r})", (repr(f"{c}yz"), "True"), [(repr(a), repr(a.startswith(c))) for a in cases],
        )  # fmt: skip

    @add("remove_letter", ("a", "e", "i", "s", "z"))
    def _(c):
        cases = ("", c, f"{c}b{c}", "hello world", f"{c * 2}x")
        return (
            f"remove_letter_{c}", "s: str", f"Return s with every '{c}' removed.",
            f"return s.replace({c!r}, '')", (repr(f"x{c}y"), "'xy'"),
            [(repr(a), repr(a.replace(c, ""))) for a in cases],
        )  # fmt: skip

    @add("item_at", (0, 1, 2, 3, 4))
    def _(k):
        lists = (list(range(10, 20)), list("abcdefg"), [k] * (k + 1), list(range(k + 1, -1, -1)))
        return (
            f"item_at_{k}", "items: list", f"Return the item at index {k} of items (the list has more than {k} items).",
            f"return items[{k}]", (repr(list(range(100, 106))), repr(100 + k)),
            [(repr(a), repr(a[k])) for a in lists],
        )  # fmt: skip

    @add("length_is", (0, 1, 3, 5, 8))
    def _(k):
        cases = ("", "a", "abc", "hello", "abcdefgh", "x" * (k + 1))
        return (
            f"has_length_{k}", "s: str", f"Return True if the string s has exactly {k} characters, else False.",
            f"return len(s) == {k}", (repr("z" * k), "True"), [(repr(a), repr(len(a) == k)) for a in cases],
        )  # fmt: skip

    @add("max_plus", (1, 2, 5, 10, 100))
    def _(k):
        cases = ([0], [3, 1, 2], [-5, -9], [7, 7, 7])
        return (
            f"max_plus_{k}", "nums: list", f"Return the largest number in nums plus {k} (nums is not empty).",
            f"return max(nums) + {k}", ("[1, 4, 2]", repr(4 + k)), [(repr(a), repr(max(a) + k)) for a in cases],
        )  # fmt: skip

    @add("join", tuple(_SEPARATORS))
    def _(sep):
        cases = ([], ["a"], ["a", "b"], ["x", "yy", "zzz"])
        return (
            f"join_with_{_SEPARATORS[sep]}", "words: list",
            f"Return the strings in words joined with {sep!r} between them.",
            f"return {sep!r}.join(words)", ("['ab', 'cd']", repr(sep.join(["ab", "cd"]))),
            [(repr(a), repr(sep.join(a))) for a in cases],
        )  # fmt: skip

    @add("minus", (1, 4, 6, 8, 10))
    def _(k):
        return (
            f"subtract_{_num(k)}", "x: int", f"Return x minus {k}.", f"return x - {k}",
            ("20", repr(20 - k)), [(a, repr(int(a) - k)) for a in ("0", str(k), "-1", "50")],
        )  # fmt: skip

    @add("between", (1, 3, 5, 10, 20))
    def _(k):
        return (
            f"is_between_0_and_{k}", "x: int", f"Return True if 0 <= x <= {k}, else False.", f"return 0 <= x <= {k}",
            (repr(k // 2), "True"), [(repr(a), repr(0 <= a <= k)) for a in (-1, 0, k, k + 1, 1000)],
        )  # fmt: skip

    return fams


def _name(c: str) -> str:
    return {"#": "hash"}.get(c, c.lower() if c.islower() else f"upper_{c.lower()}")


def _task(family: _Family, param: Any) -> dict[str, Any]:
    name, args, doc, body, (ex_in, ex_out), cases = family.make(param)
    prompt = f'def {name}({args}):\n    """{doc}\n    >>> {name}({ex_in})\n    {ex_out}\n    """\n'
    asserts = "\n".join(f"    assert candidate({i}) == {o}" for i, o in cases)
    return {
        "task_id": f"BasicPython/{name}",
        "prompt": prompt,
        "canonical_solution": f"    {body}\n",
        "test": f"def check(candidate):\n{asserts}\n",
        "entry_point": name,
        "family": family.key,
    }


def load_basic_python() -> list[dict[str, Any]]:
    """The 100 tasks, family by family (``family`` is an extra column, kept in the trajectories' task)."""
    tasks = [_task(f, p) for f in _families() for p in f.params]
    names = [t["task_id"] for t in tasks]
    if len(set(names)) != len(names):  # a programming error in the table above, not bad input
        raise AssertionError("basic-python task ids are not unique")
    return tasks
