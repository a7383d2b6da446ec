"""Registry[T]: things of one kind chosen by name (scheduling policies, simulator policies, ...).

A mapping: `names()` is what a `--flag`'s choices list, `registry[name]` the entry or an
`UnknownName` error (a ValueError) naming the known ones. Entries are added where the registry is
defined, so every choice is listed in one place and nothing depends on which modules were imported
first. The same shape serves any kind (mini-sglang keeps caches and backends this way).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownName(KeyError, ValueError):
    """A name no entry has: a KeyError for Mapping's `get`/`in`, a ValueError for callers (flags)."""

    def __str__(self) -> str:
        return str(self.args[0])


class Registry(Mapping[str, T], Generic[T]):
    def __init__(self, kind: str, entries: Mapping[str, T] | None = None) -> None:
        self.kind = kind  # what an entry is, for error messages ("policy", "transfer path", ...)
        self._entries: dict[str, T] = {}
        for name, entry in (entries or {}).items():
            self.add(name, entry)

    def add(self, name: str, entry: T) -> T:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add`."""
        return lambda entry: self.add(name, entry)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownName(f"unknown {self.kind} {name!r}; known: {', '.join(self._entries)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
