"""The docs point at things that exist, and speak to a user, not to the people who wrote them.

A page that links to a moved file, names a script that was renamed or cites a history entry that is gone
sends a reader nowhere; these checks fail naming the page and the dead reference. The last check keeps the
project's working vocabulary (issue numbers, work sessions, documents outside the repository) out of
what a user reads: README, docs/ and the code's comments.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from repo_files import repo_files

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
IDS = [str(p.relative_to(ROOT)) for p in PAGES]

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# a repository path written in backticks: a top-level folder of the repo, then a file with an extension
TOP = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
REPO_PATH = re.compile(rf"`((?:{'|'.join(map(re.escape, TOP))})/[\w./-]+\.(?:md|py|yaml|yml|toml|json|jsonl|lock))`")


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_relative_links_resolve(page: Path) -> None:
    dead = []
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (page.parent / target).exists():
            dead.append(target)
    assert not dead, f"{page.relative_to(ROOT)} links to files that do not exist: {dead}"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_repository_paths_named_exist(page: Path) -> None:
    text = page.read_text()
    missing = sorted({p for p in REPO_PATH.findall(text) if "<" not in p and not (ROOT / p).exists()})
    # paths a guide creates in the reader's own package, or outputs a run writes, are not in the repo
    missing = [p for p in missing if not p.startswith(("outputs/", "docs/results/learning/"))]
    assert not missing, f"{page.relative_to(ROOT)} names repository files that do not exist: {missing}"


def test_benchmark_history_entries_exist() -> None:
    """Each benchmark's table names its entry in the changelog; the entry must be a heading there."""
    current = (ROOT / "docs" / "benchmarks.md").read_text()
    history = (ROOT / "docs" / "changelog" / "benchmarks.md").read_text()
    headings = [line for line in history.splitlines() if line.startswith("#")]
    named = re.findall(r"\| history \| \[[^\]]+\]\([^)]+\), \"([^\"]+)\" \|", current)
    assert len(named) >= 10, "docs/benchmarks.md lost its per-benchmark tables"
    gone = [n for n in named if not any(n in h for h in headings)]
    assert not gone, f"docs/benchmarks.md names history entries missing from docs/changelog/benchmarks.md: {gone}"


WORKING_WORDS = re.compile(
    r"\bissue ?#?\d+|#\d{2,}\b|\bsession \d+|\bthis session\b|\bother sessions?\b|\.\./shared|NOTES\.md"
    r"|design card|seed-0\d\d|\bthe brief\b",
    re.IGNORECASE,
)


def test_no_working_vocabulary_in_docs_or_comments() -> None:
    files = repo_files("*.md", "*.py", "*.yaml", "*.toml", "Makefile", ".ci/*")
    hits = []
    for name in files:
        if name.startswith("docs/results/") or name == "tests/test_docs_links.py":
            continue  # raw run records keep what their run printed
        for n, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            if WORKING_WORDS.search(line):
                hits.append(f"{name}:{n}: {line.strip()[:120]}")
    assert not hits, "issue numbers, work sessions or outside documents in user-facing text:\n" + "\n".join(hits)
