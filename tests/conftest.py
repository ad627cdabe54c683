"""Project-wide pytest set-up.

Triton only runs on CPU through its interpreter, and TRITON_INTERPRET must be set
before triton is first imported, so it is set here, before any test module loads.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
