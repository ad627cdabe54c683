"""CPU memory that every decode step walks (the weights, the KV cache) in transparent huge pages.

A decode step on CPU reads every weight once and each running sequence's KV rows: about
100 MB for SmolLM2-135M in GGUF Q4_1, in 4 KiB pages by default, so some 25,000 pages per
step, and a page-table walk for each of them once the TLB (a few thousand entries) has
turned over. Scattered KV blocks pay one more walk each per layer. In 2 MiB pages the same
bytes take some fifty entries.

``empty(shape, dtype)`` returns a CPU tensor whose storage is aligned to ``HUGE_PAGE_BYTES``
and advised ``MADV_HUGEPAGE`` before anything touches it, so the kernel backs it with huge
pages as it faults in (Linux with transparent huge pages in "madvise" or "always" mode, the
distributions' default; elsewhere the advice is a no-op and the tensor is an ordinary one).
``gather_parameters(model)`` moves a CPU model's parameters into one such buffer: a model
of many small projections (SmolLM2's are 0.2-1.1 MB each) has no 2 MiB run of its own.

Measured on a 2-core AVX-512 EPYC, offline, the two alternated in one process: a 1-stream
decode step of SmolLM2-135M Q4_1 5.33 -> 4.28 ms (docs/engine.md).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)   # <asm-generic/mman-common.h>
PARAMETER_ALIGNMENT = 64    # bytes: each gathered parameter starts on a cache line


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` and ``dtype``, in huge pages where it spans
    at least one (module docstring); smaller ones are a plain ``torch.empty``."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE_BYTES or not sys.platform.startswith("linux"):
        return torch.empty(shape, dtype=dtype)
    span = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    # A private anonymous mapping of its own (a shared one is shmem, under another THP
    # setting), never malloc's: glibc raises its mmap threshold as large blocks
    # are freed, and then serves a large block from the heap, where pages may already be
    # faulted in (4 KiB) and where the advice would outlive the tensor, handed on to
    # whatever malloc puts there next. The tensor keeps the mapping alive; the unused head
    # and tail are never touched, so never resident.
    mapping = mmap.mmap(-1, span + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    _advise(mapping, offset, span)
    return raw[offset:offset + nbytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``empty``, zeroed (the zeroing faults the pages in, huge ones where advised)."""
    return empty(shape, dtype).zero_()


def gather_parameters(model: torch.nn.Module) -> int:
    """Move ``model``'s CPU parameters into one buffer from ``empty``, each a view of it
    (same values, shapes and dtypes; the ``Parameter`` objects stay the same, so tied
    weights stay tied); returns the bytes moved. Parameters that share storage with
    another parameter, are not plain strided CPU tensors, or are empty stay where they are."""
    params: dict[int, torch.nn.Parameter] = {}
    for param in model.parameters():
        if param.device.type == "cpu" and param.layout == torch.strided and param.numel() > 0:
            params[id(param)] = param
    owners: dict[int, int] = {}
    for param in params.values():
        key = param.untyped_storage().data_ptr()
        owners[key] = owners.get(key, 0) + 1
    movable = [p for p in params.values() if owners[p.untyped_storage().data_ptr()] == 1]
    offsets, total = [], 0
    for param in movable:
        total = -(-total // PARAMETER_ALIGNMENT) * PARAMETER_ALIGNMENT
        offsets.append(total)
        total += param.numel() * param.element_size()
    if total < HUGE_PAGE_BYTES:
        return 0
    arena = empty((total,), torch.uint8)
    with torch.no_grad():
        for param, offset in zip(movable, offsets, strict=True):
            nbytes = param.numel() * param.element_size()
            view = arena[offset:offset + nbytes].view(param.dtype).view(param.shape)
            view.copy_(param.data)
            param.data = view
    _release_freed_memory()
    logger.debug("gathered %d parameters (%d bytes) into huge-page memory", len(movable), total)
    return total


def _release_freed_memory() -> None:
    """Hands the heap's free pages back to the system (glibc's ``malloc_trim``): parameters
    smaller than malloc's mmap threshold were freed into the heap when they moved, and
    would otherwise stay resident, counted against the machine, until reused."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)   # glibc only
    if trim is not None:
        trim(0)


def _advise(mapping: mmap.mmap, start: int, length: int) -> None:
    try:
        mapping.madvise(MADV_HUGEPAGE, start, length)
    except (OSError, ValueError) as err:
        # no transparent huge pages in this kernel: ordinary pages, nothing else changes
        logger.debug("madvise(MADV_HUGEPAGE) failed: %s", err)
