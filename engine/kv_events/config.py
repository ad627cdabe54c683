"""``--kv-events-config``: vLLM's ``KVEventsConfig`` fields, frozen (torch-free, zmq-free).

The operator and the flag parser read it without starting anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.contract.json_object import dataclass_from_object, parse_json

PUBLISHERS = ("zmq", "null")
DEFAULT_ENDPOINT = "tcp://*:5557"   # vLLM's default PUB endpoint (bound: it has a wildcard)


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Where and how KV-cache events are published (vLLM's names and defaults).

    Args:
        enable_kv_cache_events: record and publish events at all.
        publisher: ``zmq`` or ``null`` (nothing is recorded); None = ``zmq`` when enabled.
        endpoint: the PUB socket; bound when it has a wildcard (``*``, ``::``) or is
            ``ipc://`` / ``inproc://``, connected otherwise (vLLM's rule).
        replay_endpoint: a ROUTER socket (always bound) answering replay requests, or None.
        buffer_steps: batches kept for replay.
        hwm: the PUB socket's high-water mark (messages queued per subscriber before
            ZeroMQ drops for that subscriber).
        max_queue_size: batches waiting for the publisher thread; past it the step loop
            keeps merging its records into one pending batch instead of waiting.
        topic: first frame of every message (subscribers filter on its prefix).
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("enable_kv_cache_events must be true or false")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"publisher must be one of {PUBLISHERS}, got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("replay_endpoint must be a string or null")
        for name, least in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")

    @property
    def enabled(self) -> bool:
        """Whether the engine records and publishes events (enabled, with the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parses vLLM's JSON form; ValueError names an unknown key or a bad value."""
        return dataclass_from_object(cls, parse_json(text))
