"""GGUF checkpoints (llama.cpp's format): ``--model file.gguf`` or a directory holding one.

Read with the ``gguf`` package (llama.cpp's own reader and reference dequantizer):

- ``engine.core.gguf_contract``: the metadata as a ``config.json``-style dict, which tensors
  stay quantized and what each costs in memory (pure Python, shared with the planner).
- ``files``: finding the file, reading its metadata (torch-free).
- ``arch``: the ``ArchConfig`` (torch-free).
- ``tensor_names``: llama.cpp's tensor names -> the HF names the loader maps (torch-free).
- ``tokenizer``: the vocabulary in the metadata -> the engine's ``Tokenizer``.
- ``weights``: the tensors into the engine's model (torch).
"""
