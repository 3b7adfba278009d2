"""The env service's wire format (docs/env-service.md): the protocol version, errors, the JSON codec of env state,
method arguments and results, which env methods a service exposes, and an episode's snapshot.

Why a codec driven by type hints: an env's state is a Python object the agents read (``PlanPathState`` holds a
``Grid`` with a ``frozenset`` of cells, ``ParsedMoves`` with tuples). The service sends it as plain JSON (objects,
arrays, numbers, strings), which any language can read and write; the trainer rebuilds the exact Python object
from the JSON and the annotations the env class already carries (``initial_state``'s return type, each method's
parameter and return types), so agents run unchanged against a remote env. Nothing here imports a web framework.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import json
import math
import re
import types
import typing
from collections import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from pettingflow.envs.base import Env

PROTOCOL = 1
"""The protocol version every request and response carries as ``"protocol"``; a service refuses any other."""

ROUTE_PREFIX = "/v1"
TOKEN_ENV = "PETTINGFLOW_ENV_TOKEN"
"""The environment variable holding the service's bearer token (``pettingflow env serve`` and the rollout's client)."""

EPISODE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
BASE_METHODS = ("reset", "finish_turn")
"""``Env`` methods every service exposes through ``step``, besides the env class's own (``remote_methods``)."""

#: HTTP status of each error type (docs/env-service.md, "Errors")
ERROR_STATUS: dict[str, int] = {
    "bad_request": 400,
    "protocol_mismatch": 400,
    "wrong_env": 400,
    "unknown_method": 400,
    "unauthorized": 401,
    "unknown_episode": 404,
    "not_found": 404,
    "episode_exists": 409,
    "env_error": 422,
    "internal": 500,
    "service_full": 503,
}


class CodecError(ValueError):
    """A value that cannot be sent as JSON, or JSON that does not fit the type it must become."""


class ProtocolError(Exception):
    """An error a service answers with: ``type`` (a key of ``ERROR_STATUS``), a message, for env errors the
    exception's class name."""

    def __init__(self, type_: str, message: str, exception: str | None = None) -> None:
        super().__init__(message)
        self.type = type_
        self.message = message
        self.exception = exception

    @property
    def status(self) -> int:
        return ERROR_STATUS.get(self.type, 500)

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"type": self.type, "message": self.message}
        if self.exception:
            error["exception"] = self.exception
        return {"protocol": PROTOCOL, "error": error}


def check_protocol(body: Any, who: str = "the client") -> None:
    """Raise ``ProtocolError('protocol_mismatch')`` unless ``body`` is an object with ``"protocol": PROTOCOL``."""
    if not isinstance(body, Mapping):
        raise ProtocolError("bad_request", f'the body must be a JSON object with "protocol": {PROTOCOL}')
    version = body.get("protocol")
    if version != PROTOCOL:
        said = "no protocol" if version is None else f"protocol {version!r}"
        raise ProtocolError("protocol_mismatch", f"{who} sent {said}; this side speaks env service protocol {PROTOCOL}")


# --------------------------------------------------------------------------------------------------
# values -> JSON
# --------------------------------------------------------------------------------------------------
def _sort_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def to_json(value: Any, where: str = "value") -> Any:
    """``value`` as plain JSON: dataclasses and pydantic models become objects (every field), tuples and lists
    arrays, sets and frozensets arrays in a fixed order, enums their value. Anything else is a ``CodecError``."""
    if isinstance(value, float) and not math.isfinite(value):
        raise CodecError(f"{where}: {value} is not a JSON number (NaN and infinities cannot be sent)")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return to_json(value.value, where)
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise CodecError(f"{where}: a mapping key {key!r} is neither a string nor an integer")
            out[str(key)] = to_json(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, (set, frozenset)):
        return sorted((to_json(v, f"{where}[]") for v in value), key=_sort_key)
    if isinstance(value, (list, tuple)):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise CodecError(
        f"{where}: a {type(value).__name__} cannot be sent over the env service; env state, method arguments and "
        "results must be JSON values, dataclasses or pydantic models of them"
    )


# --------------------------------------------------------------------------------------------------
# JSON -> values, by type
# --------------------------------------------------------------------------------------------------
_LISTS = (list, abc.Sequence, abc.MutableSequence, abc.Iterable, abc.Collection)
_SETS = (set, frozenset, abc.Set, abc.MutableSet)
_MAPS = (dict, abc.Mapping, abc.MutableMapping)


@functools.cache
def type_hints(obj: Any) -> dict[str, Any]:
    """``typing.get_type_hints`` of a class or function, cached; a clear error when an annotation does not resolve."""
    try:
        return typing.get_type_hints(obj)
    except Exception as exc:  # NameError for names imported only under TYPE_CHECKING, and the like
        raise CodecError(
            f"cannot resolve the type annotations of {getattr(obj, '__qualname__', obj)!r}: {exc}"
        ) from exc


def from_json(data: Any, tp: Any, where: str = "value") -> Any:
    """``data`` (plain JSON) as a value of type ``tp``: the inverse of ``to_json`` for the types env state,
    method arguments and results use (dataclasses, pydantic models, enums, unions, literals, containers)."""
    if tp is Any or tp is object:
        return data
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return from_json(data, args[0], where)
    if origin is typing.Union or origin is types.UnionType:
        if data is None and type(None) in args:
            return None
        problems = []
        for option in args:
            if option is type(None):
                continue
            try:
                return from_json(data, option, where)
            except CodecError as exc:
                problems.append(str(exc))
        raise CodecError(f"{where}: {data!r:.80} fits none of {tp}: {'; '.join(problems)}")
    if origin is typing.Literal:
        if data not in args:
            raise CodecError(f"{where}: {data!r:.80} is not one of {list(args)}")
        return data
    if tp is type(None):
        if data is not None:
            raise CodecError(f"{where}: expected null, got {data!r:.80}")
        return None
    if origin is None and isinstance(tp, type):
        return _from_json_class(data, tp, where)
    if origin in _LISTS:
        _expect(data, list, where)
        item = args[0] if args else Any
        return [from_json(v, item, f"{where}[{i}]") for i, v in enumerate(data)]
    if origin is tuple:
        _expect(data, list, where)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_json(v, args[0], f"{where}[{i}]") for i, v in enumerate(data))
        if args and args != ((),):
            if len(args) != len(data):
                raise CodecError(f"{where}: expected {len(args)} items, got {len(data)}")
            return tuple(from_json(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(data, args, strict=True)))
        return tuple(data)
    if origin in _SETS:
        _expect(data, list, where)
        item = args[0] if args else Any
        values = (from_json(v, item, f"{where}[]") for v in data)
        return set(values) if origin in (set, abc.MutableSet) else frozenset(values)
    if origin in _MAPS:
        _expect(data, dict, where)
        key_type, value_type = args if args else (str, Any)
        return {_key(k, key_type, where): from_json(v, value_type, f"{where}[{k!r}]") for k, v in data.items()}
    raise CodecError(f"{where}: the type {tp} cannot be read from JSON by the env service")


def _expect(data: Any, kind: type, where: str) -> None:
    if not isinstance(data, kind):
        raise CodecError(f"{where}: expected a JSON {'array' if kind is list else 'object'}, got {data!r:.80}")


def _key(key: str, key_type: Any, where: str) -> Any:
    if key_type is int:
        try:
            return int(key)
        except ValueError as exc:
            raise CodecError(f"{where}: the key {key!r} is not an integer") from exc
    return key


def _from_json_class(data: Any, tp: type, where: str) -> Any:
    if issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError as exc:
            raise CodecError(f"{where}: {exc}") from exc
    if tp is bool:
        if not isinstance(data, bool):
            raise CodecError(f"{where}: expected true or false, got {data!r:.80}")
        return data
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise CodecError(f"{where}: expected an integer, got {data!r:.80}")
        return data
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise CodecError(f"{where}: expected a number, got {data!r:.80}")
        return float(data)
    if tp is str:
        if not isinstance(data, str):
            raise CodecError(f"{where}: expected a string, got {data!r:.80}")
        return data
    if issubclass(tp, BaseModel):
        try:
            return tp.model_validate(data)
        except ValueError as exc:
            raise CodecError(f"{where}: {exc}") from exc
    if dataclasses.is_dataclass(tp):
        return _dataclass_from_json(data, tp, where)
    if tp in (list, tuple, set, frozenset, dict):
        _expect(data, dict if tp is dict else list, where)
        return tp(data)
    raise CodecError(f"{where}: {tp.__qualname__} is neither a JSON value, a dataclass nor a pydantic model")


def _dataclass_from_json(data: Any, tp: type, where: str) -> Any:
    _expect(data, dict, where)
    fields = {f.name: f for f in dataclasses.fields(tp)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise CodecError(f"{where}: {tp.__qualname__} has no fields {unknown} (it has {sorted(fields)})")
    hints = type_hints(tp)
    init, later = {}, {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise CodecError(f"{where}: the field {name!r} of {tp.__qualname__} is missing")
            continue
        value = from_json(data[name], hints.get(name, Any), f"{where}.{name}")
        (init if f.init else later)[name] = value
    obj = tp(**init)
    for name, value in later.items():
        object.__setattr__(obj, name, value)
    return obj


# --------------------------------------------------------------------------------------------------
# which methods a service exposes
# --------------------------------------------------------------------------------------------------
_HOOKS = frozenset(vars(Env)) | {"episode_info"}


@dataclass(frozen=True)
class MethodSpec:
    """One env method callable through ``step``: its parameters (after ``self``) and whether it is a coroutine."""

    name: str
    params: tuple[str, ...]
    is_async: bool
    function: Callable[..., Any]

    def hints(self) -> dict[str, Any]:
        return type_hints(self.function)

    def encode_args(self, bound: Mapping[str, Any]) -> dict[str, Any]:
        return {name: to_json(value, f"{self.name}({name})") for name, value in bound.items()}

    def decode_args(self, args: Any) -> dict[str, Any]:
        if not isinstance(args, Mapping):
            raise CodecError(f"{self.name}: 'args' must be a JSON object of the method's parameters")
        unknown = sorted(set(args) - set(self.params))
        if unknown:
            raise CodecError(f"{self.name} has no parameters {unknown} (it takes {list(self.params)})")
        hints = self.hints()
        return {k: from_json(v, hints.get(k, Any), f"{self.name}({k})") for k, v in args.items()}

    def decode_result(self, data: Any) -> Any:
        return from_json(data, self.hints().get("return", Any), f"{self.name}() result")


def _method_spec(name: str, function: Callable[..., Any], owner: type) -> MethodSpec:
    params = list(inspect.signature(function).parameters.values())[1:]  # after self
    bad = [p.name for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if bad:
        raise CodecError(f"{owner.__qualname__}.{name} takes *args/**kwargs ({bad}), which the env service cannot send")
    return MethodSpec(name, tuple(p.name for p in params), inspect.iscoroutinefunction(function), function)


@functools.cache
def remote_methods(env_cls: type[Env]) -> dict[str, MethodSpec]:
    """The methods of ``env_cls`` a service runs for the agents (``step``): ``reset``, ``finish_turn``, and the
    class's own public methods, i.e. every plain function defined by a class between ``Env`` and ``env_cls``
    whose name has no leading underscore and is not an ``Env`` hook (``initial_state``, ``solved``, ``fork``,
    ``team_outcome``, ``episode_info``, ...). An env class may list them itself as ``service_methods``."""
    declared = getattr(env_cls, "service_methods", None)
    out = {name: _method_spec(name, getattr(Env, name), Env) for name in BASE_METHODS}
    for klass in reversed(env_cls.__mro__):
        if klass is Env or not issubclass(klass, Env) or klass is object:
            continue
        for name, attr in vars(klass).items():
            if name.startswith("_") or name in _HOOKS or not inspect.isfunction(attr):
                continue
            if declared is None or name in declared:
                out[name] = _method_spec(name, attr, klass)
    missing = sorted(set(declared or ()) - set(out))
    if missing:
        raise CodecError(f"{env_cls.__qualname__}.service_methods names {missing}, which are not its methods")
    return out


def state_type(env_cls: type[Env]) -> Any:
    """The type of ``env.state``: the return annotation of ``initial_state`` (``Any``: the JSON as it comes)."""
    return type_hints(env_cls.initial_state).get("return", Any)


# --------------------------------------------------------------------------------------------------
# an episode as the service reports it
# --------------------------------------------------------------------------------------------------
def snapshot(episode_id: str, env: Env) -> dict[str, Any]:
    """What every create/observe/step/fork answer carries: the episode's counters, history and state, and the
    values the engine reads when the episode ends (``outcome``, ``team_outcome``, ``episode_info``, ``solved``,
    ``failed``). Those are
    computed here, with the state, so a trainer never has to ask for them again; an env whose ``team_outcome``
    or ``episode_info`` raises reports the error in ``outcome_error``."""
    out: dict[str, Any] = {
        "episode_id": episode_id,
        "current_turn": env.current_turn,
        "max_turns": env.max_turns,
        "done": bool(env.done),
        "truncated": bool(env.truncated),
        # how the episode ended (solved, failed, max_turns; None while it runs): absent from older services
        "outcome": getattr(env, "outcome", None),
        "seed": env.seed,
        "history": to_json(env.history, "history"),
        "state": to_json(env.state, "state"),
        "solved": None,
        "failed": None,
        "team_outcome": None,
        "episode_info": None,
        "outcome_error": None,
    }
    try:
        out["solved"] = bool(env.solved())
        out["failed"] = bool(env.failed())
        out["team_outcome"] = to_json(env.team_outcome(), "team_outcome")
        info = getattr(env, "episode_info", None)
        if callable(info):
            out["episode_info"] = to_json(info(), "episode_info")
    except Exception as exc:  # reported with the state; the trainer raises it if the engine asks for the value
        out["outcome_error"] = f"{type(exc).__name__}: {exc}"
    return out
