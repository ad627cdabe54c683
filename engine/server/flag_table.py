"""A ``kvpilot serve`` flag as one row, and what is built from rows: the argparse parser,
its ``--help`` text and the flag tables of ``docs/serving.md``.

A row says everything about a flag once: its names, how argparse reads it, its default
and one help text, which ``--help`` and the docs both print. A flag that sets an
``EngineArgs`` field names it (``engine=``): its default is then that field's default
(read, never repeated) and ``args.engine_args_from_namespace`` copies the value over, so
adding an engine flag is one row here plus its ``EngineArgs`` field. Other defaults live
in the row itself, or in the server's constant the row names.

Torch-free: the operator parses engine arguments with the same parser.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.engine_args import EngineArgs

HONOURED = "honoured"
REFUSED = "refused"
POSITIONAL_MODEL = "MODEL"   # vLLM's positional model argument (``vllm serve MODEL``)


@dataclass(frozen=True, slots=True, kw_only=True)
class Flag:
    """One ``kvpilot serve`` flag.

    Args:
        name: the long option (``--enable-lora``), or ``MODEL`` for the positional model.
        help: what it does in kvpilot, or (refused) why kvpilot cannot honour it; the
            ``--help`` text and the docs' meaning column.
        status: ``HONOURED`` or ``REFUSED`` (refused: the flag stops start-up with one
            line naming it, and is hidden from ``--help``).
        vllm: a ``vllm serve`` flag (False: kvpilot's own).
        aliases: short forms (``-tp``).
        group: the ``--help`` section (set by ``section``).
        engine: the ``EngineArgs`` field this flag sets; the default is that field's.
        default: the default of a flag that sets no ``EngineArgs`` field.
        default_text: how ``--help`` and the docs state a default that is not a plain
            value (``"the model's"``); None: the value itself, nothing for None.
        type, choices, action, nargs, metavar, dest: as for ``add_argument``.
    """

    name: str
    help: str
    status: str = HONOURED
    vllm: bool = True
    aliases: tuple[str, ...] = ()
    group: str = ""
    engine: str | None = None
    default: Any = None
    default_text: str | None = None
    type: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    action: str | type[argparse.Action] | None = None
    nargs: str | int | None = None
    metavar: str | None = None
    dest: str | None = None

    def __post_init__(self) -> None:
        if self.status not in (HONOURED, REFUSED):
            raise ValueError(f"{self.name}: status must be {HONOURED!r} or {REFUSED!r}")
        if self.engine is not None and self.engine not in EngineArgs.__dataclass_fields__:
            raise ValueError(f"{self.name}: EngineArgs has no field {self.engine!r}")
        if self.engine is not None and self.default is not None:
            raise ValueError(f"{self.name}: the default of an engine flag is EngineArgs.{self.engine}'s")

    @property
    def option_strings(self) -> tuple[str, ...]:
        return (self.name, *self.aliases) if self.name.startswith("-") else self.aliases

    @property
    def meaning(self) -> str:
        """The docs' name for ``help``."""
        return self.help

    @property
    def dest_name(self) -> str:
        """The namespace attribute the flag sets."""
        return self.dest or ("model_tag" if self.name == POSITIONAL_MODEL
                             else self.name.lstrip("-").replace("-", "_"))

    @property
    def resolved_default(self) -> Any:
        """The value the flag has when it is not given."""
        if self.engine is not None:
            return EngineArgs.__dataclass_fields__[self.engine].default
        if self.default is None and self.action in ("store_true", "store_false"):
            return self.action == "store_false"
        return self.default

    @property
    def default_label(self) -> str | None:
        """The default as ``--help`` and the docs state it; None when there is none to state."""
        if self.default_text is not None:
            return self.default_text
        value = self.resolved_default
        if value is None or self.action == "store_false":   # a store_false spells out the off side
            return None
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, float):
            return f"{value:g}"
        if isinstance(value, list | tuple):
            return "[" + ", ".join(f'"{v}"' for v in value) + "]"
        return str(value)

    @property
    def help_text(self) -> str:
        """``help`` with its default: what ``--help`` prints."""
        label = self.default_label
        if label is None or (self.action == "store_true" and label == "off"):
            return self.help
        return f"{self.help} (default: {label})"


def section(title: str, *flags: Flag) -> tuple[Flag, ...]:
    """``flags`` in the ``--help`` section ``title``."""
    return tuple(dataclasses.replace(f, group=title) for f in flags)


def refusal_message(flag: Flag) -> str:
    """The one line a refused flag stops start-up with."""
    return f"{flag.name} is not supported by kvpilot: {flag.help}"


class OnOff(argparse.BooleanOptionalAction):
    """``--x`` / ``--no-x``, with the row's help as given (Python 3.11's own adds the default
    a second time)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, help=help, **kwargs)
        self.help = help


class _Refuse(argparse.Action):
    """Exits with ``refusal_message`` as soon as the flag is seen (whatever follows it)."""

    def __init__(self, option_strings: Sequence[str], dest: str, flag: Flag, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="*", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS, **kwargs)
        self.flag = flag

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.exit(2, f"{parser.prog}: error: {refusal_message(self.flag)}\n")


def _add(container, flag: Flag) -> None:
    if flag.status == REFUSED:
        container.add_argument(*flag.option_strings, action=_Refuse, flag=flag,
                               dest=f"_refused_{flag.name.lstrip('-').replace('-', '_')}")
        return
    spec = {"type": flag.type, "choices": flag.choices, "action": flag.action,
            "nargs": flag.nargs, "metavar": flag.metavar}
    kwargs = {k: v for k, v in spec.items() if v is not None}
    kwargs["help"] = flag.help_text.replace("%", "%%")      # argparse %-formats help
    kwargs["default"] = flag.resolved_default
    if flag.name == POSITIONAL_MODEL:
        container.add_argument(flag.dest_name, nargs="?", metavar=POSITIONAL_MODEL, **kwargs)
        return
    container.add_argument(*flag.option_strings, dest=flag.dest_name, **kwargs)


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag]) -> None:
    """Adds ``flags`` to ``parser``: honoured ones in their ``--help`` sections (in the
    order the sections first appear), refused ones hidden."""
    flags = list(flags)
    groups: dict[str, Any] = {}
    for flag in flags:
        if flag.status == HONOURED and flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group) if flag.group else parser
    for flag in flags:
        _add(groups[flag.group] if flag.status == HONOURED else parser, flag)


def _names(flag: Flag) -> str:
    if flag.name == POSITIONAL_MODEL:
        return f"`{POSITIONAL_MODEL}`"
    if flag.action is OnOff:
        return f"`{flag.name}` / `--no-{flag.name[2:]}`"
    metavar = f"{flag.metavar}..." if flag.metavar and flag.nargs == "+" else flag.metavar
    first = f"{flag.name} {metavar}" if metavar else flag.name
    return ", ".join(f"`{n}`" for n in (first, *flag.aliases))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_flags_table(flags: Iterable[Flag]) -> str:
    """A Markdown table of honoured flags: names, default, meaning; kvpilot's own marked †."""
    lines = ["| Flag | Default | Meaning |", "|---|---|---|"]
    for flag in flags:
        if flag.status != HONOURED:
            continue
        mark = "" if flag.vllm else " †"
        default = flag.default_label
        if default is None:
            default = "—"
        elif flag.default_text is None and default not in ("on", "off"):
            default = f"`{default}`"          # a value, as typed on the command line
        lines.append(f"| {_names(flag)}{mark} | {_cell(default)} | {_cell(flag.help)} |")
    return "\n".join(lines) + "\n"


def render_refused_table(flags: Iterable[Flag]) -> str:
    """A Markdown table of refused flags and why each is refused."""
    lines = ["| vLLM flag | Why kvpilot refuses it |", "|---|---|"]
    for flag in flags:
        if flag.status == REFUSED:
            names = ", ".join(f"`{n}`" for n in (flag.name, *flag.aliases))
            lines.append(f"| {names} | {_cell(flag.help)} |")
    return "\n".join(lines) + "\n"
