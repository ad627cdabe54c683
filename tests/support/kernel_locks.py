"""Hold every CPU kernel's build lock, as a server's first start would find a build in progress."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kvpilot.kernels import cpu_layer_ops, gguf_matmul_cpu, kernel_cache, paged_decode_cpu


@contextlib.contextmanager
def holding_every_kernel_build() -> Iterator[None]:
    """The build locks of the kernels this CPU loads, held until the block ends (the kernel
    cache's folder comes from ``TORCH_EXTENSIONS_DIR``: point it at a test's own folder)."""
    isa = torch.backends.cpu.get_cpu_capability()
    with contextlib.ExitStack() as held:
        for kernel in (paged_decode_cpu, cpu_layer_ops, gguf_matmul_cpu):
            name, flags = kernel.variant(isa)
            directory = kernel_cache.cache_directory(name, kernel.SOURCE, flags, kernel.LDFLAGS)
            directory.mkdir(parents=True)
            held.enter_context(kernel_cache.build_lock(directory, "kernel"))
        yield
