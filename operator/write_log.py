"""What the operator's own writes returned, until the watch has caught up with them.

A watch event arrives some time after the write that caused it, so the operator remembers
what each of its writes returned and ``children.Children`` uses whichever of the watched
copy and the remembered write is newer (``resource_version``). Where a resource version is
not an integer, a remembered write simply wins until it is ``ttl`` seconds old.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.operator.resource_version import resource_version
from kvpilot.operator.resources import ChildKind

Key = tuple[ChildKind, str, str]  # kind, namespace, name


@dataclass(frozen=True, slots=True)
class _Written:
    obj: dict | None          # None: deleted by the operator
    rv: int | None
    at: float                 # time.monotonic() of the write


class WriteLog:
    """What the operator's own writes returned, until the watch has caught up with them.

    Args:
        ttl: seconds after which a remembered write is dropped regardless (the watch has
            long caught up by then; this bounds memory and non-integer resource versions).
        clock: monotonic time source (tests pass a fake).
    """

    def __init__(self, ttl: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl
        self._clock = clock
        self._items: dict[Key, _Written] = {}

    def __len__(self) -> int:
        return len(self._items)

    def record(self, key: Key, obj: Mapping[str, Any] | None, rv: int | None = None) -> None:
        """Remember that ``key`` is now ``obj`` (None: deleted at resourceVersion ``rv``)."""
        if obj is not None:
            rv = resource_version(obj)
            obj = dict(obj)
        self._items[key] = _Written(obj, rv, self._clock())
        self._expire()

    def observe(self, key: Key, event_type: str | None, obj: Mapping[str, Any]) -> bool:
        """Note a watch event for ``key``; returns whether it is the echo of the operator's
        own write (nothing new to react to).

        Once the watch has delivered the written version, or anything newer, the index is
        at least as fresh as the write and the write is forgotten.
        """
        written = self._items.get(key)
        rv = resource_version(obj)
        if written is None or rv is None or written.rv is None:
            return False
        deleted = event_type == "DELETED"
        echo = written.obj is not None and not deleted and rv == written.rv
        if rv > written.rv or (rv == written.rv and (deleted or written.obj is not None)):
            del self._items[key]
        return echo

    def overlay(self, key: Key, watched: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        """``watched`` (the index's copy, None if absent) or the operator's newer write."""
        written = self._items.get(key)
        if written is None:
            return watched
        if self._clock() - written.at > self._ttl:
            del self._items[key]
            return watched
        rv = resource_version(watched)
        if written.rv is not None and rv is not None:
            # a tombstone holds until a newer object shows up (a re-creation)
            caught_up = rv > written.rv if written.obj is None else rv >= written.rv
            if caught_up:
                del self._items[key]
                return watched
        elif written.obj is None and watched is None:
            del self._items[key]  # the watch has seen the deletion too
            return None
        return written.obj

    def _expire(self) -> None:
        now = self._clock()
        if len(self._items) > 64:
            for key in [k for k, w in self._items.items() if now - w.at > self._ttl]:
                del self._items[key]
