"""GGUF checkpoints (llama.cpp's format): ``--model file.gguf`` or a directory holding one.

Read with the ``gguf`` package (llama.cpp's own reader and reference dequantizer):

- ``contract.gguf``: the metadata as a ``config.json``-style dict, which tensors
  stay quantized and what each costs in memory (pure Python, shared with the planner).
- ``files``: finding the file, reading its metadata (torch-free).
- ``arch``: the ``ArchConfig`` (torch-free).
- ``tensor_names``: llama.cpp's tensor names -> the HF names the loader maps (torch-free).
- ``weights``: the tensors into the engine's model (torch).

The vocabulary in the metadata becomes a tokenizer in ``kvpilot.engine.text.gguf_tokenizer``.
May import: the ``gguf`` package, ``kvpilot.contract`` and the rest of ``kvpilot.engine.model``
(``files``, ``arch`` and ``tensor_names`` stay torch-free: the text side reads files with them).
"""
