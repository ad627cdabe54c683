"""The argument parser class of every ``kvpilot`` command (torch-free, tiny: the
dispatcher imports it before it knows the subcommand)."""

from __future__ import annotations

import argparse


class ArgumentParser(argparse.ArgumentParser):
    """argparse without prefix matching (``allow_abbrev=False``): ``--api-ke X`` is an
    error, not ``--api-key X`` in disguise (which would slip past the operator's and the
    CRD's guard against ``--api-key`` in ``extraArgs``), and adding a flag never changes
    what a prefix meant. Sub-parsers are made of their parent's class, so every
    subcommand of the dispatcher gets the rule."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
