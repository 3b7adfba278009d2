"""Load ``configs/<name>.yaml`` (or any YAML path), apply ``a.b=value`` overrides, validate.

Errors are ``ConfigError``: one line per problem, each naming the file and the dotted key path, so a
user can fix a 200-line config without reading a pydantic traceback.
"""

from __future__ import annotations

import copy
import re
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


OVERRIDES_DOC = """\
## Overrides

Words `KEY=VALUE` after the config's name change one key each, over the file's values and in the order given,
before the config is validated: `pettingflow train code-env run.iterations=5`, `pettingflow config show code-env
training.lr=2e-5` (prints the result), a Prefect deployment's `overrides` parameter, `PF_OVERRIDES` of `make
run`, `flows/learn.py --overrides`. They all go through `configs/loader.py` (`parse_override`,
`apply_override`), so every form below works in each of them. `VALUE` is read as YAML: `0.7` is a number,
`true` a bool, `null` None, `[a, b]` a list, `{rank: 8}` a map.

`KEY` is a dotted path of the tables below. An entry of a list (`policies[]`, `agents[]`, or a list value such
as `run.code_paths`) is picked by

- **index**, 0 first, negative from the end, in brackets or as a dotted number (the same):
  `agents[1].class_path=mypkg.agents:Reviewer`, `agents[0].sampling.temperature=0.7`,
  `policies[0].model=smollm2-135m-instruct`, `agents.1.sampling.max_tokens=64`;
- **name**, in lists of entries that have a `name` (`agents`, `policies`):
  `agents.test_generator.sampling.temperature=0.7`, `policies.shared.lora.rank=8`.

The rule: the segment right after a list selects one of its entries. A whole number (`1`, `-1`) is an index,
anything else the `name` of an entry. A list has no keys of its own, so a selector never shadows a config key
(`agents.sampling.temperature` looks for an agent named `sampling`). An entry whose name is a whole number is
picked by index only, and a name two entries share is refused (pick it by index). Brackets hold an index only.

An override changes an entry that the config has; it does not add one. To change a list's length, set the
whole list (`run.code_paths=[src, lib]`), or write a config that `extends` this one and lists the entries.

Mistakes are errors that name the override's key:

```text
agents[5]: the config has 2 agents (0..1)
agents.reviewer: no agent named 'reviewer'; the config's agents: code_generator, test_generator
agents.1.sampling.temprature: unknown key (check spelling; `pettingflow config show` lists valid keys)
```

Validation names an entry by its index, whichever form the override used. In a shell, brackets are glob
characters: bash passes `agents[1].policy=shared` on unless a file of that name exists, zsh stops with
"no matches found". Quote such a word (`'agents[1].policy=shared'`) or write the dotted form
(`agents.1.policy=shared`).
"""


class _Index(str):
    """A key segment written in brackets (``agents[1]``). Why a marker: ``env.options.0`` may name a
    mapping's key ``"0"``, but ``env.options[0]`` can only mean a list entry, and a mapping there is an error."""


_SEGMENT = re.compile(r"([^\[\]]+)((?:\[[^\[\]]*\])*)")
_BRACKETS = re.compile(r"\[([^\[\]]*)\]")
_INDEX = re.compile(r"-?\d+")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b[1].c=value`` -> (["a", "b", "1", "c"], value); the value is parsed as a YAML scalar/list/map.

    ``b[1]`` and ``b.1`` give the same parts (the ``[1]`` part is marked as written in brackets, see
    ``_Index``), so every caller treats both forms alike.
    """
    if "=" not in text:
        raise ConfigError("override", [(text, "overrides look like key.path=value")])
    key, raw = text.split("=", 1)
    key = key.strip()
    parts: list[str] = []
    for segment in key.split("."):
        match = _SEGMENT.fullmatch(segment)
        if not segment or not match:
            why = "empty key path segment" if not segment else f"cannot read segment {segment!r}"
            raise ConfigError("override", [(key, f"{why}; write key.path=value, e.g. agents[1].policy=shared")])
        parts.append(match.group(1))
        for inside in _BRACKETS.findall(match.group(2)):
            if not _INDEX.fullmatch(inside):
                by_name = f"{match.group(1)}.{inside or '<name>'}"
                problem = f"[{inside}] is not a list index: brackets hold a whole number (agents[1]); name: {by_name}"
                raise ConfigError("override", [(key, problem)])
            parts.append(_Index(inside))
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError("override", [(key, f"cannot parse value {raw!r}: {exc}")]) from exc
    return parts, value


def apply_override(data: dict[str, Any], parts: list[str], value: Any) -> None:
    """Set ``value`` at ``parts`` in nested dicts/lists.

    The part after a list selects an entry: a whole number is an index (``agents.0``, or ``agents[0]`` from
    ``parse_override``), anything else the ``name`` of an entry (``agents.code_generator``). Missing map keys
    are created so that pydantic, not this function, decides whether the key is allowed (and reports it with
    its full path); a list entry that is not there is an error here, since nothing could validate it.
    """
    node: Any = data
    shown = ""  # the key so far, as errors show it: indexes in brackets, names after a dot
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if isinstance(node, list):
            index = _list_index(node, part, shown, top_level=depth == 1)
            shown = f"{shown}[{part}]" if _INDEX.fullmatch(part) else f"{shown}.{part}"
            if last:
                node[index] = value
            else:
                node = node[index]
        elif isinstance(node, dict):
            if isinstance(part, _Index):
                raise ConfigError("override", [(f"{shown}[{part}]", _not_a_list(shown, node))])
            shown = f"{shown}.{part}" if shown else part
            if last:
                node[part] = value
            else:
                if part not in node or node[part] is None:
                    if isinstance(parts[depth + 1], _Index):
                        raise ConfigError("override", [(f"{shown}[{parts[depth + 1]}]", _unset_list(shown))])
                    node[part] = {}
                node = node[part]
        else:
            path = f"{shown}[{part}]" if isinstance(part, _Index) else f"{shown}.{part}"
            problem = f"{shown} is {node!r} ({type(node).__name__}): it has no keys or entries to set"
            raise ConfigError("override", [(path, problem)])


def _not_a_list(shown: str, node: dict[str, Any]) -> str:
    keys = f" (its keys: {', '.join(map(str, node))})" if node else ""
    return f"{shown} is a mapping, not a list: brackets index a list; write {shown}.<key>{keys}"


def _unset_list(shown: str, empty: bool = False) -> str:
    """Why an index cannot land: the list is there but empty, or not in the config's mapping at all."""
    if empty:
        return f"{shown} is empty here, so it has no entry to change; set the whole list: {shown}=[...]"
    return (
        f"{shown} is not set in the config: check the spelling (`pettingflow config show` prints every key); "
        f"a list left at its default has no entry to change, so set the whole list: {shown}=[...]"
    )


_SINGULAR = {"agents": "agent", "policies": "policy"}


def _list_index(items: list[Any], part: str, shown: str, top_level: bool) -> int:
    """The index of the entry ``part`` selects in ``items`` (the list at key ``shown``), or a ``ConfigError``
    that says what the list holds. ``top_level``: ``shown`` is a section of the config (``agents``)."""
    count = len(items)
    by_index = bool(_INDEX.fullmatch(part))
    path = f"{shown}[{part}]" if by_index else f"{shown}.{part}"
    if not count:
        raise ConfigError("override", [(path, _unset_list(shown, empty=True))])
    if by_index:
        index = int(part)
        if not -count <= index < count:
            noun = _SINGULAR.get(shown, shown) if count == 1 else shown
            where = f"the config has {count} {noun}" if top_level else f"{shown} has {count} entries"
            raise ConfigError("override", [(path, f"{where} (0..{count - 1})")])
        return index
    if not all(isinstance(item, dict) and "name" in item for item in items):
        problem = f"the entries of {shown} have no names: pick one by index, {shown}[0]..{shown}[{count - 1}]"
        raise ConfigError("override", [(path, problem)])
    found = [i for i, item in enumerate(items) if str(item["name"]) == part]
    if len(found) > 1:
        problem = f"{len(found)} {shown} are named {part!r} (at {', '.join(map(str, found))}); pick one by index"
        raise ConfigError("override", [(path, problem)])
    if not found:
        names = ", ".join(str(item["name"]) for item in items)
        problem = f"no {_SINGULAR.get(shown, 'entry')} named {part!r}; the config's {shown}: {names}"
        raise ConfigError("override", [(path, problem)])
    return found[0]


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


def upgrade_stored_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A config a run stored (``run.json``, ``attempt.json``) in today's spelling, so runs started before a setting
    was renamed still resume, re-run, summarize, evaluate and export. A config a user writes is not upgraded: it
    fails with a message giving the new spelling (``ExperimentConfig``'s checks), since reading an old spelling
    silently would keep two meanings of one name alive; a stored config records what already ran, so its meaning
    is known.

    - before ``rollout.tree.branches`` (Nov 28 2026), tree runs stored K candidates per turn as ``env.group_size``:
      now ``rollout.tree.branches: K`` and ``env.group_size: 1`` (the same rollouts).
    """
    data = copy.deepcopy(raw)
    rollout, env = data.get("rollout") or {}, data.get("env") or {}
    tree = rollout.get("tree") if isinstance(rollout.get("tree"), dict) else {}
    if rollout.get("mode") == "tree" and tree.get("branches") is None and int(env.get("group_size") or 1) > 1:
        rollout["tree"] = {**tree, "branches": int(env["group_size"])}
        env["group_size"] = 1
    return data


def validate_stored_config(
    raw: dict[str, Any], source: str = "<dict>", overrides: list[str] | tuple[str, ...] = ()
) -> ExperimentConfig:
    """``validate_config`` for a config a run stored: upgraded to today's spelling first (``upgrade_stored_config``)."""
    return validate_config(upgrade_stored_config(raw), source=source, overrides=overrides)


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
