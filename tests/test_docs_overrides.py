"""Every config override written in README.md and docs/ is a valid override of a shipped config.

An override shown to a reader (`PF_OVERRIDES="run.iterations=5"`, `pettingflow config show code-env
env.group_size=4`, a re-run's `training.lr=1e-6`) must load as written: a renamed key or a value of the wrong
type fails here, naming the page. Tokens with placeholders (`<s>`) or flow-style YAML values cut by the page's
formatting are skipped; only keys under a config section count (other dotted `a=b` text is not a config key).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pettingflow.configs.loader import load_config
from pettingflow.configs.settings import ExperimentConfig

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SECTIONS = "|".join(ExperimentConfig.model_fields)
OVERRIDE = re.compile(rf"(?<![\w.])((?:{SECTIONS})(?:\.[A-Za-z_0-9]+|\[-?\d+\])+=[^\s`\"')\],;]+)")


def overrides_in(text: str) -> list[str]:
    out = []
    for token in OVERRIDE.findall(text):
        token = token.rstrip(".:")
        value = token.split("=", 1)[1]
        if "<" in value or value.startswith(("{", "[")) or not value:
            continue
        out.append(token)
    return sorted(set(out))


def test_the_pages_show_overrides() -> None:
    readme = overrides_in((ROOT / "README.md").read_text())
    assert "env.group_size=4" in readme and "training.lr=1e-6" in readme
    config_page = overrides_in((ROOT / "docs" / "reference" / "config.md").read_text())
    assert "agents[1].class_path=mypkg.agents:Reviewer" in config_page  # list entries in brackets are checked too


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_override_on_the_page_loads(page: Path) -> None:
    bad = []
    for token in overrides_in(page.read_text()):
        try:
            load_config("code-env", [token])
        except Exception as exc:  # every failure is reported with its token
            bad.append(f"{token}: {str(exc).splitlines()[-1].strip()}")
    assert not bad, f"{page.relative_to(ROOT)}: overrides that do not load:\n" + "\n".join(bad)
