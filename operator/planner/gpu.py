"""GPU specifications and the built-in GPU catalogue.

Each entry carries the three numbers the planner's roofline needs:

- ``memory_bytes``: total device memory as CUDA reports it to a process
  (``cudaMemGetInfo`` / ``torch.cuda.mem_get_info``: the figure engines multiply by
  ``gpu_memory_utilization``). It is below both the marketing figure and the
  ``nvidia-smi`` total, and it varies a little with the driver: an "80 GB" H100 shows
  81,559 MiB (79.65 GiB) in ``nvidia-smi`` but 79.11 to 79.22 GiB to CUDA. Each entry
  takes the smallest CUDA figure found in public logs and names them in
  ``memory_source``; where no log was found the entry says "estimate" and scales the
  ``nvidia-smi`` total by the lowest CUDA / ``nvidia-smi`` ratio measured on an HBM part
  (A100 80GB: 79.25 / 80.00 = 0.9906).
- ``memory_bandwidth_bytes_per_s``: peak HBM/GDDR bandwidth from NVIDIA's data sheet.
- ``bf16_flops``: peak *dense* BF16 tensor-core FLOP/s (data sheets quote the
  2:4-sparse figure first; dense is half of it; GeForce figures with FP32 accumulate).

``gpus_per_node``: GPUs one node of this type usually has (the most one pod can use
for tensor parallelism; a replica that needs more spans nodes with pipeline
parallelism). Data-centre parts come on 8-GPU boards (NVIDIA HGX / DGX H100, H200,
B200, A100; AWS p4d / p5 / p5e / p6); AWS's largest L4 and A10G instances, g6.48xlarge
and g5.48xlarge, have 8; GeForce cards are counted 4 to a workstation. A cluster
whose nodes differ says so with the ``gpus_per_node`` override (``spec.gpu.perNode``).

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
# Lowest CUDA / nvidia-smi total ratio measured on an HBM GPU (A100 80GB: 79.25 GiB of
# 81,920 MiB), used where no CUDA figure was found.
CUDA_VISIBLE_RATIO_ESTIMATE = 79.25 / 80.0


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
        memory_source: where ``memory_bytes`` comes from (for the derivation).
        gpus_per_node: GPUs of this type in one node (see module doc).
    """

    name: str
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    bf16_flops: float
    description: str = ""
    large_defaults: bool = False
    memory_source: str = ""
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or isinstance(self.gpus_per_node, bool) \
                or not 1 <= self.gpus_per_node <= 64:
            raise ValueError(f"gpus_per_node must be an integer in [1, 64], got {self.gpus_per_node!r}")
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
        return replace(self, memory_bytes=int(memory_gib * GIB),
                       memory_source=f"{memory_gib:g} GiB given")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _gpu(name: str, cuda_gib: float, bandwidth_gb_s: float, bf16_tflops: float,
         description: str, large: bool, source: str, per_node: int = 8) -> GPUSpec:
    return GPUSpec(name, int(cuda_gib * GIB), bandwidth_gb_s * 1e9, bf16_tflops * 1e12, description, large,
                   source, per_node)


def _estimate(nvidia_smi_mib: int) -> float:
    """CUDA-visible GiB estimated from an nvidia-smi total (see module doc)."""
    return round(nvidia_smi_mib * MIB * CUDA_VISIBLE_RATIO_ESTIMATE / GIB, 2)


# memory: GiB as CUDA reports it (sources inline); bandwidth (GB/s) and dense BF16 TFLOP/s:
# NVIDIA data sheets (A10G: AWS's figure for the G5 variant, 70 TFLOP/s vs the A10's 125;
# GeForce: the Ampere / Ada whitepapers' FP16-with-FP32-accumulate tensor figures).
GPU_CATALOG: dict[str, GPUSpec] = {g.name: g for g in (
    _gpu("l4", 22.05, 300, 121, "NVIDIA L4 24GB GDDR6", False,
         "CUDA total 22.05 GiB in an out-of-memory report on vLLM's L4 CI queue "
         "(github.com/vllm-project/afd-plugin/pull/250); nvidia-smi shows 23,034 MiB"),
    _gpu("a10g", 22.18, 600, 70, "NVIDIA A10G 24GB GDDR6 (AWS G5)", False,
         "CUDA total 22.18 GiB reported for an NVIDIA A10, the board the A10G is AWS's "
         "variant of (github.com/OpenBMB/MiniCPM-V/issues/640)"),
    _gpu("rtx-4090", 23.55, 1008, 165, "NVIDIA GeForce RTX 4090 24GB GDDR6X", False,
         "vLLM's breakdown in github.com/vllm-project/vllm/issues/13061 (0.98 x total = 13.95 weights "
         "+ 0.25 non-torch + 0.19 activations + 8.69 KV GiB -> 23.55 GiB); out-of-memory reports show "
         "23.64 GiB (github.com/3DTopia/Phidias-Diffusion/issues/8); the smaller is used", per_node=4),
    _gpu("rtx-3090", 23.58, 936, 71, "NVIDIA GeForce RTX 3090 24GB GDDR6X", False,
         "vLLM's total_gpu_memory=23.58GiB (github.com/vllm-project/vllm/issues/10517, "
         "github.com/vllm-project/vllm/pull/14447)", per_node=4),
    _gpu("a100-40gb", 39.50, 1555, 312, "NVIDIA A100-SXM4-40GB HBM2", False,
         "CUDA total 39.50 GiB (github.com/TianheWu/CoSeR/issues/10); 39.59 GiB elsewhere "
         "(github.com/raoyongming/DenseCLIP/issues/52); the smaller is used"),
    _gpu("a100-80gb", 79.25, 2039, 312, "NVIDIA A100-SXM4-80GB HBM2e", False,
         "CUDA total 79.25 GiB (github.com/levihsu/OOTDiffusion/issues/235); 79.32 GiB in "
         "github.com/vllm-project/vllm-omni/issues/276; the smaller is used"),
    _gpu("h100-80gb", 79.11, 3350, 989, "NVIDIA H100 80GB HBM3 (SXM)", True,
         "CUDA total 79.11 GiB (github.com/vllm-project/vllm/issues/27508); 79.18 GiB in "
         "llm-d/llm-d-benchmark config_explorer/empirical-vllm-memory-results.md and 79.22 GiB in "
         "github.com/vllm-project/vllm/pull/10511; the smallest is used"),
    _gpu("h200", 139.72, 4800, 989, "NVIDIA H200 141GB HBM3e (SXM)", True,
         "CUDA total 139.72 GiB in vLLM's profile on 8 of them (github.com/vllm-project/vllm/issues/10702); "
         "nvidia-smi shows 143,771 MiB (github.com/sgl-project/sglang/issues/3196)"),
    _gpu("b200", _estimate(183359), 8000, 2250, "NVIDIA B200 180GB HBM3e (HGX)", True,
         "estimate: nvidia-smi 183,359 MiB x 0.9906"),
)}

# What NVIDIA's GPU feature discovery puts in the ``nvidia.com/gpu.product`` node label for
# each catalogue GPU: the NVML device name with spaces replaced by dashes. Only the variants
# whose memory matches the catalogue entry are listed (the PCIe A100s have the SXM parts'
# memory; the H100 PCIe / NVL do not match h100-80gb's bandwidth and are left out). MIG
# slices ("...-MIG-1g.10gb") and shared GPUs ("...-SHARED") are other products on purpose.
GPU_NODE_PRODUCTS: dict[str, tuple[str, ...]] = {
    "l4": ("NVIDIA-L4",),
    "a10g": ("NVIDIA-A10G",),
    "rtx-4090": ("NVIDIA-GeForce-RTX-4090",),
    "rtx-3090": ("NVIDIA-GeForce-RTX-3090",),
    "a100-40gb": ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB"),
    "a100-80gb": ("NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"),
    "h100-80gb": ("NVIDIA-H100-80GB-HBM3",),
    "h200": ("NVIDIA-H200",),
    "b200": ("NVIDIA-B200",),
}

GPU_ALIASES: dict[str, str] = {
    "a100": "a100-80gb", "h100": "h100-80gb", "h100-sxm": "h100-80gb", "h200-141gb": "h200",
    "b200-180gb": "b200", "a10": "a10g", "3090": "rtx-3090", "4090": "rtx-4090",
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
               description: str = "custom GPU", gpus_per_node: int = 8) -> GPUSpec:
    """A GPU not in the catalogue, from its memory (GiB), bandwidth (GB/s) and dense BF16 TFLOP/s."""
    for label, value in (("memory_gib", memory_gib), ("memory_bandwidth_gbps", memory_bandwidth_gb_s),
                         ("bf16_tflops", bf16_tflops)):
        if value is None or value <= 0:
            raise ValueError(f"a custom GPU needs {label} > 0")
    return GPUSpec("custom", int(memory_gib * GIB), memory_bandwidth_gb_s * 1e9, bf16_tflops * 1e12,
                   description, False, f"{memory_gib:g} GiB given", gpus_per_node)


def gpu_node_products(name: str) -> tuple[str, ...]:
    """The ``nvidia.com/gpu.product`` label values of a catalogue GPU (name or alias)."""
    return GPU_NODE_PRODUCTS[get_gpu(name).name]
