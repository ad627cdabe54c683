"""``--dtype auto``: the dtype the model computes in, from its checkpoint and the device.

- A GPU: the checkpoint's dtype (bfloat16 where it names none the engine runs).
- A CPU with native bfloat16 arithmetic (AVX512-BF16 or AMX, read from ``/proc/cpuinfo``):
  bfloat16, whatever the checkpoint holds, as vLLM-CPU does for float32 checkpoints; the
  matmuls then use the bf16 dot-product instructions and read half the bytes (about
  twice as fast).
- Any other CPU: float32 (16-bit matmuls are emulated there and slower than float32). A
  GGUF file's decode tokens then take 8-bit activations all the same (``EngineArgs`` sets
  ``ModelConfig.gguf_float32_q8``; ``layers.gguf_linear``): an explicit ``--dtype float32``
  is the exact path.

Torch-free; ``resolve_auto_dtype`` returns the reason beside the choice, for the log.
"""

from __future__ import annotations

from kvpilot.contract.constants import MODEL_DTYPES
from kvpilot.engine.model.cpu_info import CPUInfo, cpu_info

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def resolve_auto_dtype(checkpoint_dtype: str, device: str, cpu: CPUInfo | None = None) -> tuple[str, str]:
    """``(dtype, why)`` for a checkpoint stored in ``checkpoint_dtype`` on ``device``
    (``cpu``: this machine's CPU unless given)."""
    if device != "cpu":
        if checkpoint_dtype in MODEL_DTYPES and checkpoint_dtype != "auto":
            return checkpoint_dtype, f"the checkpoint's dtype, on {device}"
        return "bfloat16", f"the checkpoint's dtype ({checkpoint_dtype}) is not one the engine runs, on {device}"
    cpu = cpu or cpu_info()
    native = [f for f in BF16_FLAGS if f in cpu.flags]
    if native:
        return "bfloat16", (f"the CPU has native bfloat16 ({', '.join(native)}); the checkpoint is "
                            f"{checkpoint_dtype}; --dtype float32 keeps full precision")
    return "float32", ("the CPU has no native bfloat16 (neither avx512_bf16 nor amx_bf16 in /proc/cpuinfo): "
                       "16-bit matmuls would be slower than float32")
