"""``pettingflow models ...``: prepare and list local models (registered by ``pettingflow/cli.py``)."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from pettingflow.inference.models import DEFAULT_MODEL, KNOWN_MODELS, ModelError, is_prepared, model_dir, prepare_model

models_app = typer.Typer(no_args_is_help=True, add_completion=False, help="Prepare and list local models.")


@models_app.callback()
def _models() -> None:
    """Prepare and list local models (kept under $PETTINGFLOW_HOME/models)."""


@models_app.command("prepare")
def prepare(
    name: Annotated[str, typer.Option("--name", help=f"Model to prepare; known: {', '.join(KNOWN_MODELS)}.")] = (
        DEFAULT_MODEL
    ),
    force: Annotated[bool, typer.Option("--force", help="Convert again even if already prepared.")] = False,
) -> None:
    """Convert a known model into a local Hugging Face folder (offline) and print its path."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not force and is_prepared(model_dir(name)):
        typer.echo(str(model_dir(name)))
        return
    typer.secho(f"preparing {name} (converting the GGUF file once; under a minute on a small CPU) ...", err=True)
    try:
        path = prepare_model(name, force=force)
    except ModelError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    typer.echo(str(path))


@models_app.command("list")
def list_models() -> None:
    """Known model names, whether each is prepared, and where."""
    for name, source in KNOWN_MODELS.items():
        path = model_dir(name)
        state = "prepared" if is_prepared(path) else "not prepared"
        typer.echo(f"{name}\t{state}\t{path}\t{source.description}")
