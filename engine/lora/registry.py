"""The adapters the engine serves, by name, and where their weights are.

Three tiers, as vLLM's LoRA managers have them: every registered adapter has a name and
a path; up to ``max_cpu_loras`` have their weights in host memory (least recently used
first out, read from disk again when a request needs one); up to ``max_loras`` sit in
device slots (least recently used first out). A request holds a reference to its
adapter from ``acquire`` to ``release``: its weights stay in host memory meanwhile, and
an adapter removed (``remove``) while requests use it keeps serving them and is freed
when the last one finishes; new requests for the name fail at once (``LoRANotFoundError``).
The scheduler never runs more distinct adapters in a batch than there are slots, so
``slots_for`` always finds a slot that no request of the step needs.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvpilot.engine.lora.checkpoint import LoRAWeights
from kvpilot.engine.lora.layers import LoRASlots
from kvpilot.engine.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRANotFoundError(ValueError):
    """No adapter of that name is loaded."""


class LoRAExistsError(ValueError):
    """An adapter of that name is already loaded."""


@dataclass(eq=False, slots=True)
class _Adapter:
    request: LoRARequest
    base_model_name: str | None
    weights: LoRAWeights | None          # None: not in host memory
    num_refs: int = 0
    removed: bool = False


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """What /v1/models and the metrics say about an adapter."""

    name: str
    path: str
    base_model_name: str | None
    rank: int | None


class LoRARegistry:
    """Args:
        read: reads and checks an adapter directory (raises ``LoRACheckpointError``).
        slots: the device slots.
        host_capacity: ``max_cpu_loras``.
    """

    def __init__(self, read: Callable[[str], LoRAWeights], slots: LoRASlots, host_capacity: int) -> None:
        self._read = read
        self.slots = slots
        self._host_capacity = host_capacity
        self._by_name: dict[str, _Adapter] = {}
        self._by_id: dict[int, _Adapter] = {}         # registered, or removed but still in use
        self._host: OrderedDict[int, None] = OrderedDict()    # ids with host weights, LRU first
        self._device: OrderedDict[int, int] = OrderedDict()   # id -> slot, LRU first
        self._free_slots = list(range(slots.num_slots - 1, -1, -1))
        self._ids = itertools.count(1)
        self.num_reads = 0        # checkpoint reads (first loads and re-reads after eviction)
        self.num_slot_loads = 0   # host -> device copies

    # ---- names ----------------------------------------------------------------
    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Register and read an adapter; LoRAExistsError / LoRACheckpointError."""
        if name in self._by_name:
            raise LoRAExistsError(f"The lora adapter '{name}' has already been loaded.")
        weights = self._read_weights(path)
        request = LoRARequest(name, next(self._ids), str(path), f"{name}:{weights.digest[:24]}")
        adapter = _Adapter(request, base_model_name, weights)
        self._by_name[name] = adapter
        self._by_id[request.lora_id] = adapter
        self._keep_in_host(adapter)
        logger.info("LoRA adapter %r loaded from %s (rank %d)", name, path, weights.rank)
        return request

    def remove(self, name: str) -> None:
        """Unregister ``name``; requests using it finish with it, then it is freed."""
        adapter = self._by_name.pop(name, None)
        if adapter is None:
            raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.")
        adapter.removed = True
        if adapter.num_refs == 0:
            self._drop(adapter)
        logger.info("LoRA adapter %r removed (%d request(s) still using it)", name, adapter.num_refs)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def adapters(self) -> list[AdapterInfo]:
        return [AdapterInfo(a.request.lora_name, a.request.lora_path, a.base_model_name,
                            a.weights.rank if a.weights is not None else None)
                for a in self._by_name.values()]

    # ---- requests ---------------------------------------------------------------
    def request_for(self, name: str) -> LoRARequest:
        """``name``'s request identity (its hash key) without a reference or a weight load
        (for lookups that run nothing, e.g. explaining a prefix-cache miss)."""
        adapter = self._by_name.get(name)
        if adapter is None:
            raise LoRANotFoundError(f"The model `{name}` does not exist.")
        return adapter.request

    def acquire(self, name: str) -> LoRARequest:
        """A reference for one request (its weights in host memory until ``release``)."""
        adapter = self._by_name.get(name)
        if adapter is None:
            raise LoRANotFoundError(f"The model `{name}` does not exist.")
        if adapter.weights is None:
            adapter.weights = self._read_weights(adapter.request.lora_path)
        adapter.num_refs += 1
        self._keep_in_host(adapter)
        return adapter.request

    def release(self, request: LoRARequest) -> None:
        adapter = self._by_id.get(request.lora_id)
        if adapter is None:
            return
        adapter.num_refs -= 1
        if adapter.num_refs == 0 and adapter.removed:
            self._drop(adapter)

    def slots_for(self, lora_ids: Iterable[int]) -> dict[int, int]:
        """Device slot of each adapter a step needs, loading those not resident (evicting
        the least recently used adapters no request of the step needs)."""
        needed = set(lora_ids)
        result = {}
        for lora_id in needed:
            slot = self._device.get(lora_id)
            if slot is None:
                slot = self._free_slot(needed)
                weights = self._by_id[lora_id].weights
                self.slots.load(slot, weights)
                self._device[lora_id] = slot
                self.num_slot_loads += 1
            self._device.move_to_end(lora_id)
            result[lora_id] = slot
        return result

    @property
    def num_device_resident(self) -> int:
        return len(self._device)

    @property
    def num_host_resident(self) -> int:
        return len(self._host)

    # ---- tiers ------------------------------------------------------------------
    def _read_weights(self, path: str) -> LoRAWeights:
        weights = self._read(path)
        self.num_reads += 1
        return weights

    def _free_slot(self, needed: set[int]) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        for lora_id in self._device:
            if lora_id not in needed:
                return self._device.pop(lora_id)
        raise RuntimeError(f"a step needs more than {self.slots.num_slots} LoRA adapters "
                           "(the scheduler admits at most --max-loras distinct adapters)")

    def _keep_in_host(self, adapter: _Adapter) -> None:
        lora_id = adapter.request.lora_id
        self._host[lora_id] = None
        self._host.move_to_end(lora_id)
        while len(self._host) > self._host_capacity:
            victim = next((i for i in self._host if self._by_id[i].num_refs == 0 and i != lora_id), None)
            if victim is None:
                break   # every host adapter is in use: over capacity until one finishes
            del self._host[victim]
            self._by_id[victim].weights = None

    def _drop(self, adapter: _Adapter) -> None:
        lora_id = adapter.request.lora_id
        self._by_id.pop(lora_id, None)
        self._host.pop(lora_id, None)
        adapter.weights = None
        slot = self._device.pop(lora_id, None)
        if slot is not None:
            self._free_slots.append(slot)
