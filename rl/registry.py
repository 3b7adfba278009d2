"""Name -> implementation tables for what ``AlgorithmSettings`` selects by name.

Each implementation registers itself with one decorator where it is defined, and the function that uses
it looks it up by the configured name::

    ADVANTAGE_ESTIMATORS = Registry("advantage estimator", "algorithm.advantage_estimator")

    @ADVANTAGE_ESTIMATORS.register("grpo")
    def _grpo(rewards, groups, eps): ...

    ADVANTAGE_ESTIMATORS.get("grpo")  # the function; an unknown name raises a ValueError naming the known ones

``configs/settings.py`` cannot import this package (``configs/`` and ``rl/`` import nothing from the
project), so it restates the names as ``Literal``s; tests/test_rl_registries.py checks that both agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Implementations of one kind by name, in registration order.

    ``kind`` names the thing in error messages ("advantage estimator"); ``config_key`` is the setting that
    selects it ("algorithm.advantage_estimator"). Supports ``name in registry``, ``iter`` and ``len`` over
    the names, like the tuples of names it replaces.
    """

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated object under ``name`` and return it unchanged."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty str name, got {name!r}")

        def decorator(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered ({self._entries[name]!r})")
            self._entries[name] = obj
            return obj

        return decorator

    def unregister(self, name: str) -> None:
        """Remove ``name`` (for tests that register a temporary implementation); unknown names raise."""
        self.get(name)
        del self._entries[name]

    def get(self, name: str) -> T:
        """The implementation registered as ``name``, else a ValueError listing the known names."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown {self.kind} {name!r}; expected one of {self.names()}: set {self.config_key} to one of them"
            ) from None

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._entries
        except TypeError:  # unhashable: certainly not a name
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.config_key!r}, names={self.names()})"
