"""Well-known local folders: one place that decides where caches and models go."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """``$PETTINGFLOW_HOME`` (default ``~/.cache/pettingflow``): prepared models and caches."""
    return Path(os.environ.get("PETTINGFLOW_HOME", Path.home() / ".cache" / "pettingflow")).expanduser()


def models_dir() -> Path:
    """Prepared Hugging Face model folders, one per model name."""
    return home() / "models"
