"""Write the test counts the docs state (README.md, docs/quickstart.md) from pytest's own collection.

    .venv/bin/python scripts/test_counts.py          # rewrite the counts that changed
    .venv/bin/python scripts/test_counts.py --check  # exit 1 if a stated count differs from the collection

Why generated: typed counts drifted (the docs said 1142 tests, 1123 fast, while 43 functions were marked slow).
A count stands in the docs between markers, ``<!-- tests:all -->1363<!-- /tests -->`` (``all``: every collected
test, what ``make test`` runs; ``fast``: those not marked ``slow``, what ``make test-fast`` runs; ``slow``: the
rest), and ``tests/test_counts.py`` fails when one differs from the collection.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "docs" / "quickstart.md"]
MARKER = re.compile(r"<!-- tests:(all|fast|slow) -->[0-9,]*<!-- /tests -->")

# run in a child: the items pytest collects from the repo's testpaths, and whether each is marked slow
_COLLECT = """
import json, sys, pytest
class Recorder:
    items = []
    def pytest_collection_modifyitems(self, items):
        Recorder.items = [item.get_closest_marker("slow") is not None for item in items]
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[Recorder()])
print("COUNTS " + json.dumps(Recorder.items))
sys.exit(code)
"""


def counts_of(slow_flags: list[bool]) -> dict[str, int]:
    """``{"all", "fast", "slow"}`` from one flag per collected test (True: marked slow)."""
    slow = sum(slow_flags)
    return {"all": len(slow_flags), "fast": len(slow_flags) - slow, "slow": slow}


def collect() -> dict[str, int]:
    """Count the tests by collecting them (about 10 s): the same collection ``make test`` starts with."""
    out = subprocess.run(
        [sys.executable, "-c", _COLLECT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        check=False,
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("COUNTS ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(
            f"pytest --collect-only failed (exit {out.returncode}): {out.stdout[-2000:]}{out.stderr[-2000:]}"
        )
    return counts_of(json.loads(line.removeprefix("COUNTS ")))


def render(text: str, counts: dict[str, int]) -> str:
    """``text`` with every count marker holding its count."""
    return MARKER.sub(lambda m: f"<!-- tests:{m[1]} -->{counts[m[1]]}<!-- /tests -->", text)


def stale(counts: dict[str, int]) -> dict[Path, str]:
    """The pages whose stated counts differ from ``counts``, with their corrected text."""
    out = {}
    for page in PAGES:
        text = page.read_text()
        if not MARKER.search(text):
            raise RuntimeError(f"{page} states no test count between <!-- tests:... --> markers")
        if (new := render(text, counts)) != text:
            out[page] = new
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a stated count is stale, write nothing")
    args = parser.parse_args(argv)
    counts = collect()
    pages = stale(counts)
    for page, text in pages.items():
        if args.check:
            print(f"{page.relative_to(ROOT)} states other test counts than {counts}: run scripts/test_counts.py")
        else:
            page.write_text(text)
            print(f"wrote {page.relative_to(ROOT)}: {counts}")
    return 1 if args.check and pages else 0


if __name__ == "__main__":
    sys.exit(main())
