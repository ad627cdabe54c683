"""Tiny EAGLE heads for a tiny target checkpoint (random weights, EAGLE-1's layout).

The layer is one decoder layer of the target's own family, built by transformers; ``fc``
passes the target's hidden state through (plus noise) and the layer's output projections
are scaled down, so the head mostly proposes what the target's LM head says about the
position it reads: the bonus token again, right in the loops random models fall into.
Parity never depends on the head's quality; acceptances make the tests cover more.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def build_eagle_head(target: Path, out: Path, seed: int = 0, scale: float = 1e-2) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target)
    config.num_hidden_layers = 1
    torch.manual_seed(seed)
    layer = AutoModelForCausalLM.from_config(config).model.layers[0]
    tensors = {}
    for name, value in layer.state_dict().items():
        if name.startswith("input_layernorm"):
            continue   # EAGLE-1's first layer has no input norm
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            value = value * scale
        tensors[f"layers.0.{name}"] = value.contiguous()
    h = config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    fc = torch.randn(h, 2 * h, generator=gen) * scale
    fc[:, h:] += torch.eye(h)
    tensors["fc.weight"] = fc
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors")
    config_json = json.loads((target / "config.json").read_text())
    config_json["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config_json))
    return out
