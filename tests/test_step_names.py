"""A step's name is written in one place: ``StepName`` and the folder helpers in ``storage/layout.py``.

Why a test: the names are also folder names, Prefect task names, metric prefixes and resume points; a literal
``"update-"`` or ``layout.step(k, "rollouts")`` elsewhere silently breaks when a step is renamed or its folder
scheme changes. The scan reads every project module with ``ast`` (string literals only: comments are not
code, docstrings are prose) and reports ``file:line`` for each literal step name in a place that names a step:

- a string holding a per-policy step folder: ``update-...`` or ``optimizer-...`` as a path component (the
  ``<policy>`` placeholder of a message is prose and allowed);
- a bare step name (``"rollouts"``, ``"filtered"`` ...) as a path component of a string with a ``/``, as an
  argument of a call that takes a step (``layout.step``, ``ctx.step``, ``StepName``, ``step_kind``, any keyword
  whose name holds ``step``), as the default of a parameter whose name holds ``step``, assigned to a name holding
  ``step``, or compared with one (``step_name in ("validation", "baseline")``).

A bare ``"validation"`` elsewhere is a config section or a metric key, not a step: those are not reported.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from repo_files import repo_files

from pettingflow.storage.layout import OPTIMIZER_STEP_PREFIX, UPDATE_STEP_PREFIX, StepName

ROOT = Path(__file__).resolve().parents[1]
DEFINITION = Path("storage/layout.py")  # the one module allowed to spell the names
# docs/: scripts kept beside the results they produced (records of a run, not project code)
SKIP_DIRS = {".venv", "tests", "outputs", ".git", "build", "node_modules", "pettingflow.egg-info", "docs"}
NAMES = {str(s) for s in StepName}
PREFIXES = (UPDATE_STEP_PREFIX, OPTIMIZER_STEP_PREFIX)
PLACEHOLDER = re.compile(r"^<[^<>]*>")  # update-<policy>: a message describing the folder scheme
RUN_PATH = re.compile(r"^(iter|attempt)-|^_COMMITTED|^part-")  # a component only a run's folders have
STEP_CALLS = {"step", "StepName", "step_kind", "folder", "read_step_trajectories", "step_uri"}

#: literals that look like a step's name but are not one: (module, literal) -> why
NOT_STEP_NAMES: dict[tuple[str, str], str] = {
    ("runs/policy_service.py", "optimizer-snapshot-{}"): "the name of the thread writing a snapshot, not a folder",
    ("training/learner.py", "update-{}"): "the one-shot learner's Ray actor name, not a folder",
}


@dataclass(frozen=True)
class Hit:
    path: str
    line: int
    literal: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.literal!r}"


def _render(node: ast.AST) -> str | None:
    """The text of a string literal, an f-string with ``{}`` for each field (``f"update-{p}"`` -> ``update-{}``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def _per_policy(text: str) -> bool:
    """Whether ``text`` holds ``update-...``/``optimizer-...`` as a path component (not the ``<policy>`` form)."""
    for part in text.split("/"):
        for prefix in PREFIXES:
            if part.startswith(prefix) and not PLACEHOLDER.match(part[len(prefix) :]):
                return True
    return False


def _in_path(text: str) -> bool:
    """Whether a bare step name is a folder of a run path (``iter-0/rollouts``, ``.../sync/_COMMITTED.json``).
    Metric keys (``rollouts/reward_mean``, ``roofline/update/<policy>/tflops``) are not paths: not reported."""
    parts = text.split("/")
    path_like = any(RUN_PATH.match(p) for p in parts)
    return path_like and any(p in NAMES for p in parts)


def _prose(text: str) -> bool:
    """A message or description (it has spaces): prose may describe the folders, ``iter-0/baseline/``."""
    return any(c.isspace() for c in text)


def _named_step(node: ast.AST | None) -> bool:
    """Whether an expression is a name that holds a step: ``step``, ``from_step``, ``step_name``, ``s.step``."""
    if isinstance(node, ast.Name):
        return "step" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return "step" in node.attr.lower() or (node.attr == "name" and _named_step(node.value))
    return False


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _literals(node: ast.AST | None) -> list[ast.AST]:
    """The string literals of an expression that is one, or a tuple/list/set of them."""
    if node is None:
        return []
    if _render(node) is not None:
        return [node]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [c for e in node.elts for c in _literals(e)]
    return []


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _step_places(node: ast.AST) -> list[ast.AST]:
    """The expressions of ``node`` that hold a step if anything does: what a step-taking call gets, a
    ``*step*`` parameter's default, what is assigned to or compared with a ``*step*`` name."""
    if isinstance(node, ast.Call):
        if _call_name(node) in STEP_CALLS:  # layout.step(k, "rollouts"), layout.step(k, name="rollouts")
            return [*node.args, *(k.value for k in node.keywords)]
        return [k.value for k in node.keywords if k.arg and "step" in k.arg.lower()]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        args = node.args
        positional = [*args.posonlyargs, *args.args]
        pairs = [*zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True)]
        pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
        return [default for arg, default in pairs if "step" in arg.arg.lower()]
    if isinstance(node, ast.Assign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [node.value] if node.value is not None and any(_named_step(t) for t in targets) else []
    if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        return operands if any(_named_step(o) for o in operands) else []
    return []


def scan_source(source: str, path: str, exceptions: dict[tuple[str, str], str] | None = None) -> list[Hit]:
    """Literal step names in one module's source (``path`` names it in the report), but for ``exceptions``
    (default: ``NOT_STEP_NAMES``)."""
    exceptions = NOT_STEP_NAMES if exceptions is None else exceptions
    tree = ast.parse(source)
    docs = _docstrings(tree)
    pieces = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    hits: dict[int, Hit] = {}
    for node in ast.walk(tree):
        text = _render(node)
        code = text is not None and id(node) not in docs and id(node) not in pieces and not _prose(text)
        if code and text is not None and (_per_policy(text) or _in_path(text)):
            hits[id(node)] = Hit(path, node.lineno, text)
        for place in _step_places(node):
            for literal in _literals(place):
                text = _render(literal) or ""
                if text in NAMES or text in PREFIXES or _per_policy(text):
                    hits[id(literal)] = Hit(path, literal.lineno, text)
    found = [h for h in hits.values() if (h.path, h.literal) not in exceptions]
    return sorted(found, key=lambda h: (h.path, h.line, h.literal))


def project_modules() -> list[Path]:
    """Every project ``.py`` file but the definition and the tests, read at test time (folders come and go), as git
    lists them (``repo_files``: not what tests and tools leave beside the code)."""
    found = [Path(name) for name in repo_files("*.py")]
    return [rel for rel in found if rel.parts[0] not in SKIP_DIRS and rel != DEFINITION]


def test_no_literal_step_names_outside_their_definition() -> None:
    hits = [h for rel in project_modules() for h in scan_source((ROOT / rel).read_text(), rel.as_posix())]
    assert not hits, (
        "literal step names outside storage/layout.py (use StepName, StepName.UPDATE.folder(policy), "
        "optimizer_step_name, update_policy, RunLayout.update_steps):\n" + "\n".join(map(str, hits))
    )


def test_every_exception_still_matches_a_literal() -> None:
    """An entry of ``NOT_STEP_NAMES`` whose literal is gone is removed, so the list only shrinks."""
    found = set()
    for rel in project_modules():
        module = rel.as_posix()
        if any(path == module for path, _ in NOT_STEP_NAMES):
            found |= {(h.path, h.literal) for h in scan_source((ROOT / rel).read_text(), module, exceptions={})}
    stale = sorted(set(NOT_STEP_NAMES) - found)
    assert not stale, f"NOT_STEP_NAMES entries that match nothing any more (remove them): {stale}"


def test_the_scan_covers_the_code_that_names_steps() -> None:
    """The scan sees the modules that handle steps (a wrong root or skip list would make the test above vacuous)."""
    scanned = {p.as_posix() for p in project_modules()}
    assert {"steps/report.py", "analysis/inspect.py", "runs/lineage.py", "flows/iteration.py"} <= scanned
    assert any(p.startswith("bench/") for p in scanned)
    assert DEFINITION.as_posix() not in scanned


PLANTED = '''
"""A docstring may say update-<policy> and iter-k/rollouts/ freely."""
from x import layout, ctx, StepName


def f(k, policy, step_name, from_step: str = "filtered"):
    layout.step(k, "rollouts")
    ctx.step(f"update-{policy}")
    rerun(run_id, k, from_step="advantages")
    uri = f"{root}/iter-{k}/sync/_COMMITTED.json"
    snapshot = "optimizer-" + policy
    if step_name in ("validation", "baseline"):
        pass
    kind = StepName(value="report")
    return [n for n in names if n.startswith("update-")]
'''

BENIGN = '''
"""Metric keys and config sections share words with steps; they are not steps."""
SPLITS = ("validation", "train", "all")
metrics = {"rollouts": 3, "advantages/mean": 0.1, "sync": 1.0}
section = config["validation"]
mode = "sync"
message = "the update step is per policy: say which (update-<policy>)"


def f(step_name: str, metrics: dict) -> float:
    return metrics.get("report", 0.0)
'''


def test_the_scan_finds_planted_literals() -> None:
    """Each planted literal is reported at its line: the test above can fail."""
    hits = scan_source(PLANTED, "planted.py")
    assert [(h.line, h.literal) for h in hits] == [
        (6, "filtered"),
        (7, "rollouts"),
        (8, "update-{}"),
        (9, "advantages"),
        (10, "{}/iter-{}/sync/_COMMITTED.json"),
        (11, "optimizer-"),
        (12, "baseline"),
        (12, "validation"),
        (14, "report"),
        (15, "update-"),
    ], hits
    assert all(str(h).startswith(f"planted.py:{h.line}: ") for h in hits)


def test_the_scan_ignores_metric_keys_settings_and_docstrings() -> None:
    assert scan_source(BENIGN, "benign.py") == []


@pytest.mark.parametrize("literal", ["update-shared", "iter-0/optimizer-shared/", "runs/r/iter-1/filtered"])
def test_a_path_with_a_step_folder_is_a_hit_anywhere(literal: str) -> None:
    assert [h.literal for h in scan_source(f"X = {literal!r}\n", "m.py")] == [literal]


def test_update_policy_reverses_the_update_folder(tmp_path: Path) -> None:
    """``update_policy`` and ``RunLayout.update_policies`` read a policy back from its update folder; other steps,
    optimizer snapshots included, have none."""
    from pettingflow.storage.layout import RunLayout, optimizer_step_name, update_policy

    assert update_policy(StepName.UPDATE.folder("coder")) == "coder"
    assert update_policy(optimizer_step_name("coder")) is None and update_policy(StepName.ROLLOUTS) is None
    assert update_policy(UPDATE_STEP_PREFIX) is None  # no policy named ""
    with pytest.raises(ValueError, match="per policy"):
        optimizer_step_name("")
    layout = RunLayout(str(tmp_path), "r")
    for name in (StepName.UPDATE.folder("b"), StepName.UPDATE.folder("a"), optimizer_step_name("a"), StepName.SYNC):
        (Path(layout.iteration_path(0)) / name).mkdir(parents=True)
    assert layout.update_policies(0) == ["a", "b"] and layout.update_policies(1) == []
