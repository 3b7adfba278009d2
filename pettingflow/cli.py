"""The ``pettingflow`` command line. Each command is a thin shell over library code."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from pettingflow.configs.loader import ConfigError, available_configs, dump_config, load_config

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="PettingFlow: multi-agent RL, one Prefect flow per iteration."
)
config_app = typer.Typer(no_args_is_help=True, help="Inspect experiment configs.")
app.add_typer(config_app, name="config")


def fail(message: str, code: int = 2) -> None:
    """Print an error for a person (no traceback) and exit non-zero."""
    typer.secho(message, fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


@config_app.command("show")
def config_show(
    name: Annotated[str, typer.Argument(help="A shipped config name (e.g. code-env) or a path to a YAML file.")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Overrides like algorithm.filter_ratio=0.25.")] = None,
) -> None:
    """Print the resolved config (defaults filled in, overrides applied) as YAML."""
    try:
        config = load_config(name, overrides or [])
    except ConfigError as exc:
        fail(str(exc))
    sys.stdout.write(dump_config(config))


@config_app.command("list")
def config_list() -> None:
    """List the configs shipped in configs/."""
    for name in available_configs():
        typer.echo(name)


def main() -> None:  # pragma: no cover - console-script convenience
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
