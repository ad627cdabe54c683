"""GPU specifications and the built-in GPU catalogue.

Each entry carries the three numbers the planner's roofline needs:

- ``memory_bytes``: total device memory as the driver reports it (``nvidia-smi``
  "Memory-Usage" total, which is also what ``cudaMemGetInfo`` returns and what
  ``gpu_memory_utilization`` multiplies). That is below the marketing figure:
  an "80 GB" H100 reports 81,559 MiB = 79.65 GiB.
- ``memory_bandwidth_bytes_per_s``: peak HBM/GDDR bandwidth from NVIDIA's data sheet.
- ``bf16_flops``: peak *dense* BF16 tensor-core FLOP/s (data sheets quote the
  2:4-sparse figure first; dense is half of it).

``large_defaults`` mirrors vLLM's choice of scheduler defaults: on GPUs with
>= 70 GiB that are not A100s it uses max_num_batched_tokens 8192 and
max_num_seqs 1024 for its OpenAI server, elsewhere 2048 and 256. The planner
starts from the same defaults.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """One GPU model.

    Args:
        name: catalogue key (``h100-80gb``) or ``custom``.
        memory_bytes: device memory per GPU, bytes (what the driver reports).
        memory_bandwidth_bytes_per_s: peak memory bandwidth, bytes/s.
        bf16_flops: peak dense BF16 tensor FLOP/s.
        description: human name for reports.
        large_defaults: use vLLM's large-GPU scheduler defaults (see module doc).
    """

    name: str
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    bf16_flops: float
    description: str = ""
    large_defaults: bool = False

    def __post_init__(self) -> None:
        if self.memory_bytes < GIB // 4:
            raise ValueError(f"GPU memory must be at least 0.25 GiB, got {self.memory_bytes} bytes")
        if self.memory_bandwidth_bytes_per_s <= 0:
            raise ValueError("GPU memory bandwidth must be > 0")
        if self.bf16_flops <= 0:
            raise ValueError("GPU BF16 FLOP/s must be > 0")

    @property
    def default_max_num_batched_tokens(self) -> int:
        return 8192 if self.large_defaults else 2048

    @property
    def default_max_num_seqs(self) -> int:
        return 1024 if self.large_defaults else 256

    def with_memory_gib(self, memory_gib: float) -> GPUSpec:
        """The same GPU with a different memory size (MIG slice, 94 GB variant...)."""
        return replace(self, memory_bytes=int(memory_gib * GIB))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _gpu(name: str, memory_mib: int, bandwidth_gb_s: float, bf16_tflops: float,
         description: str, large: bool) -> GPUSpec:
    return GPUSpec(name, memory_mib * MIB, bandwidth_gb_s * 1e9, bf16_tflops * 1e12, description, large)


# memory: nvidia-smi total (MiB); bandwidth (GB/s) and dense BF16 TFLOP/s: NVIDIA data sheets
# (A10G: AWS's figure for the G5 variant, 70 TFLOP/s vs the A10's 125).
GPU_CATALOG: dict[str, GPUSpec] = {g.name: g for g in (
    _gpu("l4", 23034, 300, 121, "NVIDIA L4 24GB GDDR6", False),
    _gpu("a10g", 23028, 600, 70, "NVIDIA A10G 24GB GDDR6 (AWS G5)", False),
    _gpu("a100-40gb", 40960, 1555, 312, "NVIDIA A100-SXM4-40GB HBM2", False),
    _gpu("a100-80gb", 81920, 2039, 312, "NVIDIA A100-SXM4-80GB HBM2e", False),
    _gpu("h100-80gb", 81559, 3350, 989, "NVIDIA H100 80GB HBM3 (SXM)", True),
    _gpu("h200", 143771, 4800, 989, "NVIDIA H200 141GB HBM3e (SXM)", True),
    _gpu("b200", 183359, 8000, 2250, "NVIDIA B200 180GB HBM3e (HGX)", True),
)}

# What NVIDIA's GPU feature discovery puts in the ``nvidia.com/gpu.product`` node label for
# each catalogue GPU: the NVML device name with spaces replaced by dashes. Only the variants
# whose memory matches the catalogue entry are listed (the PCIe A100s have the SXM parts'
# memory; the H100 PCIe / NVL do not match h100-80gb's bandwidth and are left out). MIG
# slices ("...-MIG-1g.10gb") and shared GPUs ("...-SHARED") are other products on purpose.
GPU_NODE_PRODUCTS: dict[str, tuple[str, ...]] = {
    "l4": ("NVIDIA-L4",),
    "a10g": ("NVIDIA-A10G",),
    "a100-40gb": ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB"),
    "a100-80gb": ("NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"),
    "h100-80gb": ("NVIDIA-H100-80GB-HBM3",),
    "h200": ("NVIDIA-H200",),
    "b200": ("NVIDIA-B200",),
}

GPU_ALIASES: dict[str, str] = {
    "a100": "a100-80gb", "h100": "h100-80gb", "h100-sxm": "h100-80gb", "h200-141gb": "h200",
    "b200-180gb": "b200", "a10": "a10g",
}


def gpu_names() -> list[str]:
    """Catalogue GPU names, smallest memory first."""
    return list(GPU_CATALOG)


def get_gpu(name: str) -> GPUSpec:
    """Look a GPU up by catalogue name or alias (case-insensitive); ValueError lists the known ones."""
    key = name.strip().lower()
    key = GPU_ALIASES.get(key, key)
    try:
        return GPU_CATALOG[key]
    except KeyError:
        known = ", ".join(gpu_names())
        raise ValueError(f"unknown GPU {name!r}; known GPUs: {known} "
                         "(or 'custom' with memory, bandwidth and FLOP/s)") from None


def custom_gpu(memory_gib: float, memory_bandwidth_gb_s: float, bf16_tflops: float,
               description: str = "custom GPU") -> GPUSpec:
    """A GPU not in the catalogue, from its memory (GiB), bandwidth (GB/s) and dense BF16 TFLOP/s."""
    for label, value in (("memory_gib", memory_gib), ("memory_bandwidth_gbps", memory_bandwidth_gb_s),
                         ("bf16_tflops", bf16_tflops)):
        if value is None or value <= 0:
            raise ValueError(f"a custom GPU needs {label} > 0")
    return GPUSpec("custom", int(memory_gib * GIB), memory_bandwidth_gb_s * 1e9, bf16_tflops * 1e12,
                   description, False)


def gpu_node_products(name: str) -> tuple[str, ...]:
    """The ``nvidia.com/gpu.product`` label values of a catalogue GPU (name or alias)."""
    return GPU_NODE_PRODUCTS[get_gpu(name).name]
