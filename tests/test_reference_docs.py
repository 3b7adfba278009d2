"""The generated references (docs/reference/config.md, docs/reference/cli.md) match the code."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_pages_are_up_to_date():
    """A key or command changed without `scripts/gen_reference.py` being run fails here, naming the page."""
    gen = load_generator()
    for path, text in gen.pages().items():
        assert path.exists(), f"{path} is missing: run .venv/bin/python scripts/gen_reference.py"
        assert path.read_text() == text, f"{path} is stale: run .venv/bin/python scripts/gen_reference.py"


def test_every_config_key_and_command_is_listed():
    """Each leaf key of every settings section has a row with its default; each command has a section."""
    import typer

    from pettingflow.cli import app
    from pettingflow.configs.settings import ExperimentConfig, TrainingSettings

    gen = load_generator()
    page = gen.config_page()
    for name in TrainingSettings.model_fields:
        assert f"| `training.{name}` | " in page, name
    assert "| `training.head_chunk_tokens` | int (>= 0) | `0` |" in page
    assert "| `policies[].lora.rank` |" in page and "| `agents[].sampling.temperature` |" in page
    for section in ExperimentConfig.model_fields:
        assert f"`{section}" in page, section

    cli = gen.cli_page()

    def leaves(command, path):
        for name, sub in command.commands.items():
            if hasattr(sub, "commands"):
                yield from leaves(sub, [*path, name])
            else:
                yield " ".join([*path, name])

    commands = list(leaves(typer.main.get_command(app), ["pettingflow"]))
    assert "pettingflow check" in commands and "pettingflow train" in commands
    assert "pettingflow runs show" in commands
    for command in commands:
        assert f"### `{command}`" in cli, command


def test_every_trajectory_column_is_described() -> None:
    from pettingflow.storage.schema import COLUMN_DOCS, TRAJECTORY_FIELDS

    assert [f.name for f in TRAJECTORY_FIELDS] == list(COLUMN_DOCS)  # same columns, in file order
    page = load_generator().trajectories_page()
    for f in TRAJECTORY_FIELDS:
        assert f"| `{f.name}` | " in page, f.name
