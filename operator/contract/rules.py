"""CEL validation rules written once: rendered into the CRD, evaluated in Python.

A rule is built from a small expression vocabulary that has exactly one meaning in both
languages, so the CRD's ``x-kubernetes-validations`` and the operator's own check cannot
drift::

    Rule(~has("maxReplicas") | (f("minReplicas") <= f("maxReplicas")),
         "autoscaling.minReplicas must be <= autoscaling.maxReplicas")

renders ``!has(self.maxReplicas) || self.minReplicas <= self.maxReplicas``. The vocabulary:
``f("a.b")`` (``self.a.b``), ``has("a.b")``, ``~`` (``!``), ``&`` / ``|`` (``&&`` / ``||``),
``<= < >= > ==`` (``==`` on a field against a literal or field), ``+``, ``.starts_with(s)``
and ``each(lambda x: ...)`` (``self.all(x, ...)`` over a list). As in CEL, ``||`` is true
when any side is, ``&&`` false when any side is, even where another side cannot be
evaluated (a field that is absent), and an expression that cannot be evaluated otherwise
fails the rule. tests/operator/test_contract.py evaluates every rule with cel-python as
well and checks the two agree.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class _Missing(Exception):
    """A field an expression reads is absent (CEL: "no such key")."""


class Expr:
    """An expression over ``self`` (and bound list-item variables)."""

    precedence = 9   # CEL: || 1, && 2, comparisons 3, + 4, ! 5, primary 9

    def cel(self) -> str:
        raise NotImplementedError

    def eval(self, env: Mapping[str, Any]) -> Any:
        raise NotImplementedError

    def _wrap(self, outer: int) -> str:
        text = self.cel()
        return f"({text})" if self.precedence < outer else text

    def __invert__(self) -> Expr:
        return _Not(self)

    def __and__(self, other: Expr) -> Expr:
        return _Logic("&&", (*_flat(self, "&&"), *_flat(other, "&&")))

    def __or__(self, other: Expr) -> Expr:
        return _Logic("||", (*_flat(self, "||"), *_flat(other, "||")))

    def __le__(self, other: Any) -> Expr:
        return _Compare("<=", self, _lift(other))

    def __lt__(self, other: Any) -> Expr:
        return _Compare("<", self, _lift(other))

    def __ge__(self, other: Any) -> Expr:
        return _Compare(">=", self, _lift(other))

    def __gt__(self, other: Any) -> Expr:
        return _Compare(">", self, _lift(other))

    def __eq__(self, other: Any) -> Expr:  # type: ignore[override]
        return _Compare("==", self, _lift(other))

    __hash__ = object.__hash__

    def __add__(self, other: Any) -> Expr:
        return _Add(self, _lift(other))

    def starts_with(self, prefix: str) -> Expr:
        return _StartsWith(self, prefix)


def _flat(expr: Expr, op: str) -> tuple[Expr, ...]:
    return expr.parts if isinstance(expr, _Logic) and expr.op == op else (expr,)


def _lift(value: Any) -> Expr:
    return value if isinstance(value, Expr) else _Literal(value)


@dataclass(frozen=True, eq=False)
class _Literal(Expr):
    value: Any

    def cel(self) -> str:
        if isinstance(self.value, str):
            return "'" + self.value.replace("\\", "\\\\").replace("'", "\\'") + "'"
        return json.dumps(self.value)

    def eval(self, env: Mapping[str, Any]) -> Any:
        return self.value


@dataclass(frozen=True, eq=False)
class _Field(Expr):
    root: str            # "self" or a bound variable
    path: tuple[str, ...]

    def cel(self) -> str:
        return ".".join((self.root, *self.path))

    def eval(self, env: Mapping[str, Any]) -> Any:
        node = env[self.root]
        for part in self.path:
            if not isinstance(node, Mapping) or part not in node:
                raise _Missing(".".join((self.root, *self.path)))
            node = node[part]
        return node


@dataclass(frozen=True, eq=False)
class _Has(Expr):
    field: _Field

    def cel(self) -> str:
        return f"has({self.field.cel()})"

    def eval(self, env: Mapping[str, Any]) -> bool:
        *parents, leaf = self.field.path
        node = _Field(self.field.root, tuple(parents)).eval(env)   # CEL: the parent must exist
        return isinstance(node, Mapping) and leaf in node


@dataclass(frozen=True, eq=False)
class _Not(Expr):
    operand: Expr
    precedence = 5

    def cel(self) -> str:
        return "!" + self.operand._wrap(9)

    def eval(self, env: Mapping[str, Any]) -> bool:
        return not _boolean(self.operand.eval(env))


@dataclass(frozen=True, eq=False)
class _Logic(Expr):
    op: str              # "&&" or "||"
    parts: tuple[Expr, ...]

    @property
    def precedence(self) -> int:  # type: ignore[override]
        return 1 if self.op == "||" else 2

    def cel(self) -> str:
        # an && group inside || is parenthesized for the reader, though CEL binds it first
        inner = 3 if self.op == "||" else 2
        return f" {self.op} ".join(p._wrap(inner) for p in self.parts)

    def eval(self, env: Mapping[str, Any]) -> bool:
        decisive = self.op == "||"       # the value that settles it, from any side
        missing = None
        for part in self.parts:
            try:
                if _boolean(part.eval(env)) is decisive:
                    return decisive
            except _Missing as exc:
                missing = exc
        if missing is not None:
            raise missing
        return not decisive


@dataclass(frozen=True, eq=False)
class _Compare(Expr):
    op: str
    left: Expr
    right: Expr
    precedence = 3

    def cel(self) -> str:
        return f"{self.left._wrap(4)} {self.op} {self.right._wrap(4)}"

    def eval(self, env: Mapping[str, Any]) -> bool:
        a, b = self.left.eval(env), self.right.eval(env)
        if self.op == "==":
            return a == b and isinstance(a, bool) == isinstance(b, bool)
        if isinstance(a, bool) or isinstance(b, bool) or not all(isinstance(x, (int, float)) for x in (a, b)):
            raise _Missing(f"cannot compare {a!r} {self.op} {b!r}")
        return {"<=": a <= b, "<": a < b, ">=": a >= b, ">": a > b}[self.op]


@dataclass(frozen=True, eq=False)
class _Add(Expr):
    left: Expr
    right: Expr
    precedence = 4

    def cel(self) -> str:
        return f"{self.left._wrap(4)} + {self.right._wrap(5)}"

    def eval(self, env: Mapping[str, Any]) -> Any:
        return self.left.eval(env) + self.right.eval(env)


@dataclass(frozen=True, eq=False)
class _StartsWith(Expr):
    operand: Expr
    prefix: str

    def cel(self) -> str:
        return f"{self.operand._wrap(9)}.startsWith({_Literal(self.prefix).cel()})"

    def eval(self, env: Mapping[str, Any]) -> bool:
        value = self.operand.eval(env)
        if not isinstance(value, str):
            raise _Missing(f"startsWith on {value!r}")
        return value.startswith(self.prefix)


@dataclass(frozen=True, eq=False)
class _All(Expr):
    var: str
    body: Expr

    def cel(self) -> str:
        return f"self.all({self.var}, {self.body.cel()})"

    def eval(self, env: Mapping[str, Any]) -> bool:
        return all(_boolean(self.body.eval({**env, self.var: item})) for item in env["self"])


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Missing(f"{value!r} is not a boolean")
    return value


def f(path: str) -> Expr:
    """The field ``self.<path>``."""
    return _Field("self", tuple(path.split(".")))


def has(path: str) -> Expr:
    """Whether ``self.<path>`` is set."""
    return _Has(_Field("self", tuple(path.split("."))))


def each(body: Callable[[Expr], Expr], var: str = "a") -> Expr:
    """True when ``body`` holds for every item of the list ``self``."""
    return _All(var, body(_Field(var, ())))


@dataclass(frozen=True)
class Rule:
    """One ``x-kubernetes-validations`` entry: an expression over ``self`` and its message
    (written relative to ``spec``, as users read it: ``slo.p50PromptTokens must be ...``;
    the operator reports the same words as the API server)."""

    expr: Expr
    message: str

    @property
    def cel(self) -> str:
        return self.expr.cel()

    def openapi(self) -> dict[str, str]:
        return {"rule": self.cel, "message": self.message}

    def holds(self, value: Any) -> bool:
        """Whether ``value`` (the object or list the rule is on) satisfies the rule."""
        try:
            return _boolean(self.expr.eval({"self": value}))
        except _Missing:
            return False
