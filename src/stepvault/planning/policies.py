"""Policies from text: ``"KeepLast(3) | KeepEvery(steps=1000)"`` -> the real policy object.

A tiny, safe expression language (parsed with :mod:`ast`, never evaluated): calls of the
whitelisted policy classes below with literal arguments (numbers, strings, ``True``/
``False``/``None``), combined with ``|``. Anything else — names, attributes, arithmetic,
comprehensions — is refused with the position and what is allowed.
"""

from __future__ import annotations

import ast
from typing import Any

from .units import PlanError

__all__ = ["KEEP_NAMES", "SAVE_NAMES", "TIER_NAMES", "parse_policy"]

SAVE_NAMES = ("Every", "AtSteps", "FirstStep", "LastStep", "YoungDaly")
KEEP_NAMES = ("KeepLast", "KeepBest", "KeepEvery", "KeepWithin", "KeepPeriodic", "KeepPinned")
TIER_NAMES = ("HotLast", "CopyEvery", "MoveAfter", "ArchiveProtected")


def _classes(kind: str) -> dict[str, Any]:
    if kind == "tier":
        from .. import tiers

        return {n: getattr(tiers, n) for n in TIER_NAMES}
    from .. import policy

    names = SAVE_NAMES if kind == "save" else KEEP_NAMES
    return {n: getattr(policy, n) for n in names}


def _literal(node: ast.expr, option: str) -> Any:
    if isinstance(node, ast.Constant) and isinstance(
        node.value, (int, float, str, bool, type(None))
    ):
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and isinstance(node.operand.value, (int, float))
        and not isinstance(node.operand.value, bool)
    ):
        return -node.operand.value
    raise PlanError(
        f"{option}: argument {ast.unparse(node)!r} is not a literal (numbers, strings, "
        "True/False/None only)"
    )


def _build(node: ast.expr, classes: dict[str, Any], option: str) -> Any:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _build(node.left, classes, option) | _build(node.right, classes, option)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        cls = classes.get(node.func.id)
        if cls is None:
            raise PlanError(
                f"{option}: unknown policy {node.func.id!r}; use one of {', '.join(classes)}"
            )
        args = [_literal(a, option) for a in node.args]
        if any(k.arg is None for k in node.keywords):
            raise PlanError(f"{option}: **kwargs is not allowed")
        kwargs = {k.arg: _literal(k.value, option) for k in node.keywords if k.arg is not None}
        try:
            return cls(*args, **kwargs)
        except (TypeError, ValueError) as exc:
            raise PlanError(f"{option}: {ast.unparse(node)}: {exc}") from None
    raise PlanError(
        f"{option}: {ast.unparse(node)!r} is not a policy; write calls joined by |, "
        f"e.g. {_EXAMPLES[option]}"
    )


_EXAMPLES = {
    "--save": "Every(steps=1000) | Every(minutes=30)",
    "--keep": "KeepLast(3) | KeepEvery(steps=1000)",
    "--tiers": "HotLast(3) | CopyEvery('archive', steps=5)",
}
_KINDS = {"--save": "save", "--keep": "keep", "--tiers": "tier"}


def parse_policy(text: str, option: str) -> Any:
    """The policy object ``text`` describes; ``option`` (``--save``, ``--keep`` or
    ``--tiers``) chooses the allowed classes and names itself in errors."""
    if option not in _KINDS:
        raise ValueError(f"option must be one of {sorted(_KINDS)}, got {option!r}")
    if len(text) > 2000:
        raise PlanError(f"{option}: the expression is longer than 2000 characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise PlanError(
            f"{option}: cannot parse {text!r} ({exc.msg}); e.g. {_EXAMPLES[option]}"
        ) from None
    return _build(tree.body, _classes(_KINDS[option]), option)
