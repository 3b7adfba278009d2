"""Importing pettingflow turns Prefect's server telemetry and Ray's usage stats off unless the user chose."""

from __future__ import annotations

import os
import subprocess
import sys

CODE = (
    "import os, pettingflow; "
    "print(os.environ['PREFECT_SERVER_ANALYTICS_ENABLED'], os.environ['RAY_USAGE_STATS_ENABLED'])"
)


def run(env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True).stdout


def test_off_by_default_and_the_users_choice_kept() -> None:
    base = {
        k: v for k, v in os.environ.items() if k not in ("PREFECT_SERVER_ANALYTICS_ENABLED", "RAY_USAGE_STATS_ENABLED")
    }
    assert run(base).split() == ["false", "0"]
    chosen = base | {"PREFECT_SERVER_ANALYTICS_ENABLED": "true", "RAY_USAGE_STATS_ENABLED": "1"}
    assert run(chosen).split() == ["true", "1"]
