"""argparse ``type`` converters of the ``kvpilot serve`` flags (torch-free)."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """Parses a byte count: ``1073741824``, ``4G`` / ``4GB`` (10^9) or ``4Gi`` / ``4GiB`` (2^30)."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: expected a number of bytes, optionally with a suffix "
            "K/M/G/T (powers of 1000) or Ki/Mi/Gi/Ti (powers of 1024)"
        )
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    if binary and not unit:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: 'i' needs a unit (Ki, Mi, Gi, Ti)")
    return int(float(number) * base ** _SIZE_POWERS[unit.lower()])


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None


def _bounded(parse: Callable[[str], T], ok: Callable[[T], bool], requirement: str) -> Callable[[str], T]:
    """An argparse ``type``: ``parse(text)``, rejected with ``requirement`` unless ``ok``."""

    def convert(text: str) -> T:
        value = parse(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{requirement}, got {text!r}")
        return value

    return convert


positive_int = _bounded(_int, lambda v: v >= 1, "must be a positive integer")
non_negative_int = _bounded(_int, lambda v: v >= 0, "must be >= 0")
port = _bounded(_int, lambda v: 0 <= v <= 65535, "port must be in 0..65535")
fraction = _bounded(_float, lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")
positive_float = _bounded(_float, lambda v: v > 0.0, "must be > 0")  # also rejects nan
non_negative_float = _bounded(_float, lambda v: v >= 0.0, "must be >= 0")  # also rejects nan
max_logprobs = _bounded(_int, lambda v: v >= -1, "must be -1 (the vocabulary) or >= 0")


def json_object(text: str) -> dict[str, Any]:
    """An argparse ``type``: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def json_string_list(text: str) -> list[str]:
    """An argparse ``type``: a JSON list of strings (vLLM's form for the CORS lists)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f'invalid JSON {text!r} (expected e.g. \'["*"]\'): {exc}') from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


# vLLM's spellings of the dtypes kvpilot names differently.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def dtype(text: str) -> str:
    """An argparse ``type``: vLLM's dtype aliases, mapped before argparse checks the choices."""
    return DTYPE_ALIASES.get(text, text)


def structured_outputs_config(text: str):
    """An argparse ``type``: ``--structured-outputs-config``'s JSON object, as a
    ``StructuredOutputsConfig`` (unknown keys and bad values refused)."""
    from kvpilot.engine.config import StructuredOutputsConfig

    data = json_object(text)
    names = set(StructuredOutputsConfig.__dataclass_fields__)
    unknown = sorted(set(data) - names)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown key(s) {unknown}; kvpilot honours {sorted(names)}")
    try:
        return StructuredOutputsConfig(**data)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _from_json(parse: Callable[[str], T], text: str) -> T:
    """``parse(text)``, its TypeError / ValueError turned into argparse's error."""
    try:
        return parse(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def kv_events_config(text: str):
    """An argparse ``type``: ``--kv-events-config``'s JSON object (vLLM's fields), as a
    ``KVEventsConfig`` (unknown keys and bad values refused)."""
    from kvpilot.engine.kv_events.config import KVEventsConfig

    return _from_json(KVEventsConfig.from_json, text)


def speculative_config(text: str):
    """An argparse ``type``: ``--speculative-config``'s JSON object (vLLM's fields), as a
    ``SpeculativeConfig`` (unknown keys and bad values refused)."""
    from kvpilot.contract.speculative import SpeculativeConfig

    return _from_json(SpeculativeConfig.from_json, text)


def kv_transfer_config(text: str):
    """An argparse ``type``: ``--kv-transfer-config``'s JSON object (vLLM's fields), as a
    ``KVTransferConfig`` (unknown keys and bad values refused; whether the engine runs the
    connector is checked at start-up)."""
    from kvpilot.engine.kv_transfer.config import KVTransferConfig

    try:
        return KVTransferConfig.from_json(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def lora_module(text: str):
    """``--lora-modules`` entry: ``name=path`` or ``{"name", "path", "base_model_name"}``."""
    from kvpilot.engine.lora.config import LoRAModule

    try:
        return LoRAModule.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
