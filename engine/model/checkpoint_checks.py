"""Checks on a checkpoint before the engine builds or allocates anything for it (torch-free).

A checkpoint is input from outside (the Hub, a mirror, a claim someone else filled). The
loader never unpickles, but a hostile or broken one could still cost minutes and
gigabytes before failing (``num_hidden_layers: 1000000`` builds a million layers first)
or make it open files outside its directory. So, in order:

1. ``check_config_file``: ``config.json`` is a file of reasonable size (real ones are a
   few KiB);
2. ``check_arch_bounds``: every size in the parsed config is within ``BOUNDS``, far above
   any real model (the largest public decoders have ~126 layers, hidden size 16,384,
   vocabularies of ~262k) and far below what would exhaust a machine while building;
3. ``check_shard_names``: the shards ``model.safetensors.index.json`` names stay inside
   the model directory (no absolute paths, ``..``, or symlinks out of it);
4. ``check_tensor_list``: the safetensors headers (read without loading a tensor) hold
   exactly the layers the config declares, and the embedding and the shapes of the
   decoder's projections that are present match the config.

Each raises ``CheckpointError`` (a ``ValueError``) naming the file, the field and the limit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpilot.contract.arch_config import ArchConfig

MAX_CONFIG_BYTES = 4 << 20
# field -> inclusive upper bound (each also >= 1)
BOUNDS: Mapping[str, int] = {
    "num_hidden_layers": 1024,
    "hidden_size": 65536,
    "intermediate_size": 1 << 20,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 25,
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointError(ValueError):
    """A checkpoint the engine refuses before building anything for it."""


def check_config_file(path: Path) -> None:
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{path} is {size:,} bytes; a config.json is at most {MAX_CONFIG_BYTES:,}")


def check_arch_bounds(arch: ArchConfig) -> None:
    """Every size of ``arch`` within ``BOUNDS`` (and >= 1); the sliding window positive."""
    for name, limit in BOUNDS.items():
        value = getattr(arch, name)
        if not 1 <= value <= limit:
            raise CheckpointError(f"config.json: {name} = {value:,} is outside 1..{limit:,}")
    if arch.sliding_window is not None and arch.sliding_window < 1:
        raise CheckpointError(f"config.json: sliding_window = {arch.sliding_window} must be >= 1")


def check_shard_names(model_dir: Path, weight_map: object) -> None:
    """Refuse an index ``weight_map`` whose shard names are not files inside ``model_dir``."""
    if not isinstance(weight_map, Mapping):
        raise CheckpointError(f"model.safetensors.index.json in {model_dir}: weight_map is not an object")
    root = model_dir.resolve()
    for name in weight_map.values():
        if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name \
                or ".." in name.split("/"):
            raise CheckpointError(f"model.safetensors.index.json in {model_dir} names a shard outside "
                                  f"the model directory: {name!r}")
        if root not in (model_dir / name).resolve().parents:
            raise CheckpointError(f"model.safetensors.index.json in {model_dir}: shard {name!r} "
                                  "resolves outside the model directory")


def checkpoint_shapes(files: Iterable[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the safetensors ``files``, from their headers (no tensor is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not iterable)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _expected_shapes(arch: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Shapes the config implies for tensors of layer 0 and the embedding (name suffix -> shape)."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    return {
        "model.embed_tokens.weight": (arch.vocab_size, arch.hidden_size),
        "self_attn.q_proj.weight": (q, arch.hidden_size),
        "self_attn.k_proj.weight": (kv, arch.hidden_size),
        "self_attn.v_proj.weight": (kv, arch.hidden_size),
        "self_attn.o_proj.weight": (arch.hidden_size, q),
        "mlp.gate_proj.weight": (arch.intermediate_size, arch.hidden_size),
        "mlp.up_proj.weight": (arch.intermediate_size, arch.hidden_size),
        "mlp.down_proj.weight": (arch.hidden_size, arch.intermediate_size),
    }


def check_tensor_list(shapes: Mapping[str, tuple[int, ...]], arch: ArchConfig, where: Path) -> None:
    """The checkpoint's tensors (name -> shape, from the safetensors headers) against ``arch``.

    The decoder layers found must be exactly ``0 .. num_hidden_layers - 1``; the embedding
    and layer 0's projections, where present, must have the config's shapes (names the
    loader does not know are its own error, reported with the full list after building).
    """
    layers = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    if layers != set(range(arch.num_hidden_layers)):
        found = f"{len(layers)} (indices {min(layers)}..{max(layers)})" if layers else "none"
        raise CheckpointError(f"checkpoint in {where} does not match config.json: num_hidden_layers = "
                              f"{arch.num_hidden_layers:,}, but the weights hold layers: {found}")
    for suffix, want in _expected_shapes(arch).items():
        name = suffix if suffix.startswith("model.") else f"model.layers.0.{suffix}"
        got = shapes.get(name)
        if got is not None and tuple(got) != want:
            raise CheckpointError(f"checkpoint in {where} does not match config.json: {name} has shape "
                                  f"{tuple(got)}, the config implies {want}")
