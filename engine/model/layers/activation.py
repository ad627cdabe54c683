"""The MLP activations a config's ``hidden_act`` names, one function object each: the
models apply them, and the fused decode step recognises them by identity."""

from __future__ import annotations

import torch.nn.functional as F


def gelu_tanh(x):
    """GELU with the tanh approximation (``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": gelu_tanh}
