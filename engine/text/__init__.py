"""Tokens <-> text, torch-free.

- ``tokenizer``: ``tokenizer.json`` + ``tokenizer_config.json`` (special tokens, chat template).
- ``tiktoken_convert``: tiktoken ranks (the Qwen vocabulary) -> ``tokenizer.json``.
- ``detokenizer``: incremental detokenization (no '\\ufffd' mid-character).
- ``stop``: EOS / max-token / stop-string checks per generated token.
- ``chat_templates/``: the sandboxed Jinja environment and built-in templates.
- ``gguf_tokenizer``: the vocabulary in a GGUF file's metadata -> ``Tokenizer``'s arguments.

May import: tokenizers, jinja2, ``kvpilot.contract``, ``kvpilot.engine.core`` (requests) and
the GGUF file reader (``kvpilot.engine.model.gguf.files``, torch-free). Never torch.
"""
