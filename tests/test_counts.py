"""The test counts the docs state (README.md, docs/quickstart.md) are the suite's: scripts/test_counts.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import COLLECTED_SLOW_FLAGS

ROOT = Path(__file__).resolve().parents[1]


def load_counter():
    spec = importlib.util.spec_from_file_location("test_counts_script", ROOT / "scripts" / "test_counts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_stated_test_counts_are_the_collected_ones(request: pytest.FixtureRequest) -> None:
    """A test added, removed or marked slow without `scripts/test_counts.py` being run fails here, naming the page.
    The counts are pytest's own collection when it collected the whole suite (``make test``, ``make test-fast``:
    ``-m`` deselects after collecting), else a collection of its own (about 10 s)."""
    counter = load_counter()
    whole = request.config.args_source == pytest.Config.ArgsSource.TESTPATHS
    flags = request.config.stash.get(COLLECTED_SLOW_FLAGS, None) if whole else None
    counts = counter.counts_of(flags) if flags is not None else counter.collect()
    assert counts["all"] == counts["fast"] + counts["slow"] and counts["slow"] > 0
    stale = counter.stale(counts)
    assert not stale, f"{[str(p.relative_to(ROOT)) for p in stale]} state other counts than {counts}: " + (
        "run .venv/bin/python scripts/test_counts.py"
    )


def test_every_count_marker_is_rewritten() -> None:
    counter = load_counter()
    text = "make test: <!-- tests:all -->12<!-- /tests --> tests, <!-- tests:fast -->1,100<!-- /tests --> fast"
    assert counter.render(text, {"all": 1363, "fast": 1316, "slow": 47}) == (
        "make test: <!-- tests:all -->1363<!-- /tests --> tests, <!-- tests:fast -->1316<!-- /tests --> fast"
    )
    assert counter.counts_of([True, False, False]) == {"all": 3, "fast": 2, "slow": 1}
