"""Fault injection for the API emulator: error answers, slow answers, dropped watch streams.

A ``FaultPolicy`` sits in front of the emulator's request handling. Each ``Fault`` matches
requests by method, path (a regular expression) and User-Agent, and either delays them
(``delay``) or answers them with an API error (``status``: 409 Conflict, 429 with a
``Retry-After`` header, 500, 503) instead of serving them, for its first ``times``
matching requests or until removed. ``drop_watches`` cuts every open watch stream
(the TCP connection is closed mid-stream, as a load balancer or an API server restart
would), so clients must reconnect and resume.

Tests add faults from the test thread through ``EmulatorThread.run`` (under the
emulator's lock), so the policy needs no locking of its own.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
REASONS = {409: "Conflict", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
           504: "Timeout"}
MESSAGES = {
    409: "Operation cannot be fulfilled: the object has been modified; please apply your changes "
         "to the latest version and try again",
    429: "Too many requests, please try again later.",
    500: "Internal error occurred: injected fault",
    503: "The server is currently unable to handle the request",
    504: "The server was unable to return a response in the time allotted",
}


@dataclass
class Fault:
    """One rule of the policy.

    Args:
        status: the error to answer with (None: serve the request, after ``delay``).
        methods: HTTP methods it applies to (default: writes).
        path: regular expression searched in the request path ("" matches all).
        user_agent: only requests whose User-Agent contains this ("" matches all).
        times: how many matching requests it applies to (None: until removed).
        retry_after: seconds for a ``Retry-After`` header (429 and 503).
        delay: seconds to wait before answering (an error or the real answer).
    """

    status: int | None = None
    methods: frozenset[str] = WRITES
    path: str = ""
    user_agent: str = ""
    times: int | None = None
    retry_after: float | None = None
    delay: float = 0.0
    hits: int = 0           # requests it has applied to so far
    hit_times: list[float] = field(default_factory=list)  # time.monotonic() of each

    def __post_init__(self) -> None:
        if self.status is not None and self.status not in REASONS:
            raise ValueError(f"no canned answer for HTTP {self.status}")
        self._path = re.compile(self.path)

    @property
    def spent(self) -> bool:
        return self.times is not None and self.hits >= self.times

    def matches(self, method: str, path: str, user_agent: str) -> bool:
        return (not self.spent and method in self.methods and self.user_agent in user_agent
                and self._path.search(path) is not None)

    def answer(self) -> tuple[int, dict[str, str], dict]:
        """The HTTP status, headers and ``Status`` body of an injected error."""
        headers = {"Retry-After": f"{self.retry_after:g}"} if self.retry_after is not None else {}
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": MESSAGES[self.status], "reason": REASONS[self.status], "code": self.status}
        if self.retry_after is not None:
            body["details"] = {"retryAfterSeconds": int(self.retry_after)}
        return self.status, headers, body


@dataclass
class FaultPolicy:
    """The faults in force, and the watch streams' generation (see ``drop_watches``)."""

    faults: list[Fault] = field(default_factory=list)
    watch_generation: int = 0

    def add(self, fault: Fault) -> Fault:
        self.faults.append(fault)
        return fault

    def clear(self) -> None:
        self.faults.clear()

    def match(self, method: str, path: str, user_agent: str) -> Fault | None:
        """The first fault that applies to a request (its ``hits`` counted), else None."""
        for fault in self.faults:
            if fault.matches(method, path, user_agent):
                fault.hits += 1
                fault.hit_times.append(time.monotonic())
                return fault
        return None

    def drop_watches(self) -> None:
        """Cut every watch stream open now (the emulator closes them at once)."""
        self.watch_generation += 1
