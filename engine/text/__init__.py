"""Tokens <-> text, torch-free.

- ``tokenizer``: ``tokenizer.json`` + ``tokenizer_config.json`` (special tokens, chat template).
- ``tiktoken_convert``: tiktoken ranks (the Qwen vocabulary) -> ``tokenizer.json``.
- ``detokenizer``: incremental detokenization (no '\\ufffd' mid-character).
- ``stop``: EOS / max-token / stop-string checks per generated token.
- ``chat_templates/``: the sandboxed Jinja environment and built-in templates.

May import: tokenizers, jinja2 and ``kvpilot.engine.core`` (requests). Never torch.
"""
