"""Random PEFT LoRA adapters for tiny checkpoints, and the transformers + PEFT oracle.

Adapters are built with PEFT itself (``get_peft_model`` + ``save_pretrained``), with every
A and B drawn at random (PEFT initialises B to zero, which would make an adapter a no-op
and a parity test unable to fail).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(base: Path, out: Path, rank: int, seed: int, *, alpha: float | None = None,
                  use_rslora: bool = False, target_modules: list[str] | None = None,
                  std: float = 0.08) -> Path:
    """Save a PEFT adapter of ``rank`` for the checkpoint ``base`` into ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                        target_modules=target_modules or ALL_MODULES, lora_dropout=0.0,
                        use_rslora=use_rslora, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    peft_model.save_pretrained(out)
    return out


def random_adapter(base: Path, out: Path, rank: int, seed: int, std: float = 0.08) -> Path:
    """Save a PEFT adapter of ``rank`` on every projection of ``base`` into ``out``, written
    directly (``adapter_config.json`` and ``adapter_model.safetensors`` in PEFT's names),
    A and B drawn at random: milliseconds, where ``build_adapter`` loads transformers, PEFT
    and the model (seconds). For tests whose oracle is the engine itself, not PEFT."""
    from safetensors.torch import save_file

    from kvpilot.contract.lora_slots import ATTENTION_MODULES, projection_shapes
    from kvpilot.engine.model.hf_config import load_arch_config

    arch = load_arch_config(base)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for module, (fan_in, fan_out) in projection_shapes(arch).items():
            key = f"base_model.model.model.layers.{layer}.{'self_attn' if module in ATTENTION_MODULES else 'mlp'}"
            tensors[f"{key}.{module}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * std
            tensors[f"{key}.{module}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * std
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": rank,
        "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none", "target_modules": ALL_MODULES}))
    return out


def edit_config(adapter: Path, **changes) -> None:
    """Rewrite fields of an adapter's ``adapter_config.json``."""
    file = adapter / "adapter_config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy continuations by transformers (float32) with the adapter applied by PEFT
    (``adapter=None``: the base model alone)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 min_new_tokens=max_new, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs
