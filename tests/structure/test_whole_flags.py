"""Every command-line parser in the repository matches flags whole (``allow_abbrev=False``):
a prefix of a flag is an error, never the flag (``--api-ke`` would otherwise pass guards
that look for ``--api-key``). The ``kvpilot`` command's parsers are checked live in
tests/server/test_flag_table.py; this finds the standalone ones by reading the source."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("engine", "kernels", "operator", "contract", "scripts", "e2e")


def _parser_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else None
            if name == "ArgumentParser" and owner == "argparse":
                yield node


def test_every_argparse_parser_refuses_abbreviations():
    found, offenders = 0, []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for call in _parser_calls(ast.parse(path.read_text())):
                found += 1
                flags = {k.arg: k.value for k in call.keywords}
                value = flags.get("allow_abbrev")
                if not (isinstance(value, ast.Constant) and value.value is False):
                    offenders.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert found >= 5
    assert offenders == [], f"argparse.ArgumentParser without allow_abbrev=False: {offenders}"
