"""What the device says about its memory: the one place the engine asks it.

Memory profiling (``memory_profiling.py``) reads the device through a ``DeviceMemory``:
free and total memory (``cudaMemGetInfo``) and the torch caching allocator's allocated,
reserved and peak-allocated bytes, as a ``MemorySnapshot``. It takes three snapshots, in
this order: at engine start (before the weights), after ``begin_profile()`` (weights
loaded, peak counter reset) and after ``end_profile()`` (the profile step done).

``CudaMemory`` asks ``torch.cuda``. ``FakeDeviceMemory`` is the test hook: a simulated GPU
that answers the same questions from figures it is given, so the start-up check, the
clamp and the profiled-memory metric can be tested on a machine without a GPU. It is
switched on by the environment variable ``KVPILOT_FAKE_DEVICE_MEMORY`` holding a JSON
object (GiB figures)::

    KVPILOT_FAKE_DEVICE_MEMORY='{"total_gib": 24, "free_gib": 23.5, "weights_gib": 1,
                                "activation_gib": 0.5, "non_torch_gib": 0.25}'

``total_gib`` and ``free_gib`` (free when the engine starts) are required; the others
default to 0: what the allocator holds once the weights are loaded, how far its peak rises
in the profile step, and the non-torch memory the engine adds. With the variable set the
engine profiles on any device, CPU included, against that GPU; nothing else changes.
Under tensor parallelism every rank simulates its own GPU from the same figures, except
those a ``"ranks"`` object overrides for a rank: ``{"ranks": {"1": {"activation_gib": 1}}}``
gives rank 1 a larger activation peak than the others.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Protocol

FAKE_DEVICE_MEMORY_ENV = "KVPILOT_FAKE_DEVICE_MEMORY"
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """One reading of the device (bytes)."""

    free_bytes: int
    total_bytes: int
    torch_allocated_bytes: int
    torch_reserved_bytes: int         # held by torch's caching allocator
    torch_peak_bytes: int             # peak allocated since the last reset

    @property
    def non_torch_bytes(self) -> int:
        """In use but not through torch: CUDA context, cuBLAS workspaces, NCCL, other processes."""
        return self.total_bytes - self.free_bytes - self.torch_reserved_bytes


class DeviceMemory(Protocol):
    def snapshot(self) -> MemorySnapshot: ...

    def begin_profile(self) -> None:
        """Called once the weights are loaded: release cached blocks, reset the peak counter."""

    def end_profile(self) -> None:
        """Called after the profile step: wait for the device to finish it."""


class CudaMemory:
    """The real device, through ``torch.cuda``."""

    def __init__(self, device) -> None:
        import torch

        self._cuda = torch.cuda
        self.device = device

    def snapshot(self) -> MemorySnapshot:
        free, total = self._cuda.mem_get_info(self.device)
        return MemorySnapshot(free, total, self._cuda.memory_allocated(self.device),
                              self._cuda.memory_reserved(self.device),
                              self._cuda.max_memory_allocated(self.device))

    def begin_profile(self) -> None:
        self._cuda.empty_cache()
        self._cuda.reset_peak_memory_stats(self.device)

    def end_profile(self) -> None:
        self._cuda.synchronize(self.device)


@dataclass(slots=True)
class FakeDeviceMemory:
    """A simulated GPU for tests (see the module docstring); all figures in bytes."""

    total_bytes: int
    free_bytes: int
    weights_bytes: int = 0
    activation_bytes: int = 0
    non_torch_bytes: int = 0
    _phase: int = 0                   # 0 start, 1 weights loaded, 2 profile step done

    def __post_init__(self) -> None:
        used = self.weights_bytes + self.activation_bytes + self.non_torch_bytes
        if not 0 < self.free_bytes <= self.total_bytes or min(self.weights_bytes, self.activation_bytes,
                                                                self.non_torch_bytes) < 0:
            raise ValueError(f"{FAKE_DEVICE_MEMORY_ENV}: need 0 < free <= total and figures >= 0")
        if used > self.free_bytes:
            raise ValueError(f"{FAKE_DEVICE_MEMORY_ENV}: weights + activation + non-torch exceed free memory")

    @classmethod
    def from_json(cls, text: str, rank: int = 0) -> FakeDeviceMemory:
        """The simulated GPU of tensor-parallel rank ``rank`` (see the module docstring)."""
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{FAKE_DEVICE_MEMORY_ENV} is not valid JSON: {exc}") from None
        known = {"total_gib", "free_gib", "weights_gib", "activation_gib", "non_torch_gib"}
        ranks = spec.pop("ranks", {}) if isinstance(spec, dict) else {}
        if (not isinstance(spec, dict) or not {"total_gib", "free_gib"} <= set(spec) or set(spec) - known
                or not isinstance(ranks, dict)
                or any(not isinstance(v, dict) or set(v) - known for v in ranks.values())):
            raise ValueError(f"{FAKE_DEVICE_MEMORY_ENV} must be a JSON object with total_gib and free_gib "
                             f"and optionally weights_gib, activation_gib, non_torch_gib, and ranks "
                             f"(rank -> overrides of those)")
        spec.update(ranks.get(str(rank), {}))
        return cls(*(int(float(spec.get(k, 0)) * GIB) for k in ("total_gib", "free_gib", "weights_gib",
                                                                 "activation_gib", "non_torch_gib")))

    def snapshot(self) -> MemorySnapshot:
        weights = self.weights_bytes if self._phase >= 1 else 0
        activation = self.activation_bytes if self._phase >= 2 else 0
        non_torch = self.non_torch_bytes if self._phase >= 2 else 0
        # the caching allocator keeps the profile step's blocks reserved once it has run
        reserved = weights + activation
        return MemorySnapshot(self.free_bytes - reserved - non_torch, self.total_bytes, weights, reserved,
                              weights + activation)

    def begin_profile(self) -> None:
        self._phase = 1

    def end_profile(self) -> None:
        self._phase = 2


def device_memory_for(device, rank: int = 0) -> DeviceMemory | None:
    """The fake (as tensor-parallel rank ``rank`` sees it) when ``KVPILOT_FAKE_DEVICE_MEMORY``
    is set, CUDA on a CUDA device, else None (no profiling: on CPU the KV cache size is given)."""
    spec = os.environ.get(FAKE_DEVICE_MEMORY_ENV)
    if spec:
        return FakeDeviceMemory.from_json(spec, rank)
    if device.type == "cuda":
        return CudaMemory(device)
    return None
