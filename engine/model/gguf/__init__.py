"""GGUF checkpoints (llama.cpp's format): ``--model file.gguf`` or a directory holding one.

Read with the ``gguf`` package (llama.cpp's own reader and reference dequantizer):

- ``files``: finding the file, reading its metadata (torch-free).
- ``arch``: the metadata as a ``config.json``-style dict and so an ``ArchConfig`` (torch-free).
- ``tensor_names``: llama.cpp's tensor names -> the HF names the loader maps (torch-free).
- ``tokenizer``: the vocabulary in the metadata -> the engine's ``Tokenizer``.
- ``weights``: the tensors into the engine's model (torch).
"""
