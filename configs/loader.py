"""Load ``configs/<name>.yaml`` (or any YAML path), apply ``a.b=value`` overrides, validate.

Errors are ``ConfigError``: one line per problem, each naming the file and the dotted key path, so a
user can fix a 200-line config without reading a pydantic traceback.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pettingflow.configs.code_paths import activate_code_paths
from pettingflow.configs.settings import CombinationError, ExperimentConfig

CONFIG_DIR = Path(__file__).resolve().parent


class ConfigError(ValueError):
    """A config that cannot be used; ``problems`` holds (key path, message) pairs."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = [f"invalid config {source}:"] + [f"  {path or '<root>'}: {msg}" for path, msg in problems]
        super().__init__("\n".join(lines))


def available_configs() -> list[str]:
    """Names of the configs shipped in ``configs/``."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_config_path(name_or_path: str) -> Path:
    """A shipped config name (``code-env``) or a path to a YAML file."""
    candidate = Path(name_or_path)
    if candidate.suffix in {".yaml", ".yml"} or candidate.exists():
        if not candidate.is_file():
            raise ConfigError(str(candidate), [("", "file not found")])
        return candidate
    shipped = CONFIG_DIR / f"{name_or_path}.yaml"
    if not shipped.is_file():
        raise ConfigError(
            name_or_path,
            [("", f"no such config; shipped configs: {', '.join(available_configs())}, or pass a YAML path")],
        )
    return shipped


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a","b","c"], value); the value is parsed as a YAML scalar/list/map."""
    if "=" not in text:
        raise ConfigError("override", [(text, "overrides look like key.path=value")])
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not key.strip() or any(not p for p in parts):
        raise ConfigError("override", [(key, "empty key path segment")])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError("override", [(key, f"cannot parse value {raw!r}: {exc}")]) from exc
    return parts, value


def apply_override(data: dict[str, Any], parts: list[str], value: Any) -> None:
    """Set ``value`` at ``parts`` in nested dicts/lists.

    List items are addressed by index (``agents.0.policy``) or, for lists of named maps, by name
    (``agents.code_generator.sampling.temperature``). Missing map keys are created so that pydantic,
    not this function, decides whether the key is allowed (and reports it with its full path).
    """
    node: Any = data
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        path = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            index = _list_index(node, part, path)
            if last:
                node[index] = value
            else:
                node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                if part not in node or node[part] is None:
                    node[part] = {}
                node = node[part]
        else:
            raise ConfigError("override", [(path, f"cannot set a key inside a {type(node).__name__} value")])


def _list_index(items: list[Any], part: str, path: str) -> int:
    if part.lstrip("-").isdigit():
        index = int(part)
        if not -len(items) <= index < len(items):
            raise ConfigError("override", [(path, f"index {index} out of range for a list of {len(items)}")])
        return index
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("name") == part:
            return i
    names = [item.get("name") for item in items if isinstance(item, dict)]
    raise ConfigError("override", [(path, f"no list item named {part!r}; names: {names}")])


def load_config(name_or_path: str, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Read, override and validate a config; raise ``ConfigError`` naming the file and key paths."""
    path = resolve_config_path(name_or_path)
    return validate_config(read_config_mapping(path), source=str(path), overrides=overrides)


def read_config_mapping(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config file's mapping, with ``extends: <config name or path>`` resolved.

    Why: the arms of a study differ in one or two settings; ``extends`` lets an arm's file say only those, so
    the arms cannot drift apart in the rest. The parent is read first, then this file's keys are merged over it
    (maps key by key, lists and scalars replaced whole); a parent may extend another, a cycle is an error.
    """
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), [("", f"not valid YAML: {exc}")]) from exc
    if not isinstance(raw, dict):
        raise ConfigError(str(path), [("", f"top level must be a mapping, got {type(raw).__name__}")])
    parent_name = raw.pop("extends", None)
    if parent_name is None:
        return raw
    if not isinstance(parent_name, str):
        raise ConfigError(str(path), [("extends", f"must name one config, got {parent_name!r}")])
    relative = path.parent / parent_name
    parent = resolve_config_path(str(relative) if relative.suffix in {".yaml", ".yml"} else parent_name)
    if parent.resolve() in seen or parent.resolve() == path.resolve():
        chain = " -> ".join(str(p) for p in (*seen, path.resolve(), parent.resolve()))
        raise ConfigError(str(path), [("extends", f"configs extend each other in a cycle: {chain}")])
    return _merged(read_config_mapping(parent, (*seen, path.resolve())), raw)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def validate_config(
    raw: dict[str, Any], source: str = "<dict>", overrides: list[str] | tuple[str, ...] = ()
) -> ExperimentConfig:
    """Validate an already-parsed mapping (plus overrides) into an ``ExperimentConfig``."""
    data = copy.deepcopy(raw)
    if overrides:
        source = f"{source} with overrides {list(overrides)}"
    for text in overrides:
        parts, value = parse_override(text)
        try:
            apply_override(data, parts, value)
        except ConfigError as exc:
            raise ConfigError(source, exc.problems) from exc
    try:
        config = ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, _problems(exc)) from exc
    missing = activate_code_paths(config.run.code_paths)  # the classes it names import from here on
    if missing:
        problem = "is not a folder here; give the folder that holds your package (it must exist where the run runs)"
        raise ConfigError(source, [("run.code_paths", f"{p} {problem}") for p in missing])
    return config


def _problems(exc: ValidationError) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for err in exc.errors():
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, CombinationError):
            problems.extend(inner.problems)
            continue
        path = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check spelling; `pettingflow config show` lists valid keys)"
        elif "input" in err and err["type"] != "missing":
            msg = f"{msg} (got {err['input']!r})"
        problems.append((path, msg))
    return problems


def dump_config(config: ExperimentConfig) -> str:
    """The resolved config as YAML, in field order."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
