"""Init-container entry point: download an ``hf://org/name[@revision]`` model into a directory.

Runs in the engine image before the engine starts, so that the engine only ever reads a
local directory. ``python -m kvpilot.operator.model_fetch --uri hf://Qwen/Qwen3-0.6B --dest
/models/model``. The token comes from ``HF_TOKEN`` (the operator maps the spec's
credentials Secret into the environment). Only weights, configs and tokenizer files are
fetched (no ``*.bin`` / ``*.pth`` duplicates of the safetensors).
"""

from __future__ import annotations

import argparse
import re
import sys

HF_URI = re.compile(r"^hf://(?P<repo>[^/@\s]+/[^/@\s]+)(@(?P<rev>\S+))?$")
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]


def parse_hf_uri(uri: str) -> tuple[str, str | None]:
    """``hf://org/name[@rev]`` -> ``("org/name", rev or None)``; ValueError otherwise."""
    match = HF_URI.match(uri)
    if match is None:
        raise ValueError(f"not an hf://org/name[@revision] URI: {uri!r}")
    return match["repo"], match["rev"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpilot.operator.model_fetch",
                                     description="Download a Hugging Face model for the engine.")
    parser.add_argument("--uri", required=True, help="hf://org/name[@revision]")
    parser.add_argument("--dest", required=True, help="directory to download into")
    args = parser.parse_args(argv)
    try:
        repo_id, revision = parse_hf_uri(args.uri)
    except ValueError as exc:
        parser.error(str(exc))
    from huggingface_hub import snapshot_download  # lazy: only the init container needs it

    path = snapshot_download(repo_id, revision=revision, local_dir=args.dest,
                             allow_patterns=ALLOW_PATTERNS)
    print(f"downloaded {repo_id}@{revision or 'main'} to {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
