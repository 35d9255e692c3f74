"""Options declared once: each public option's type, range and excluded partners in one table.

A table sits next to the options it declares (``fit``'s in :mod:`fitkit.training.options`, a
callback's in its own module). :func:`declared` runs the table's checks on the arguments a call
was given, before the function's body, so a refused call changes nothing; the messages are
fitkit's (argument, expected, received, fix) and come from :mod:`fitkit.checks`' helpers.
Every table is registered under its owner's name (:data:`TABLES`): the test suite enumerates
them and feeds each option wrong types, out-of-range values and excluded partners.

Kinds: ``"int"``, ``"number"``, ``"bool"``, ``"choice"``, ``"text"``, ``"path"``,
``"callable"``, and ``"custom"`` (the check is the option's own ``check``, or, for an option whose
check needs the data or the model, the function named in ``checked_in`` that runs before step 1).
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from fitkit.checks import FitkitWarning, check_bool, check_every, check_int, check_mode, check_number

__all__ = [
    "Option",
    "Table",
    "declare",
    "declared",
    "check_options",
    "TABLES",
    "verbose_option",
    "every_option",
    "mode_option",
]

_NO_EXAMPLE = object()


@dataclass(frozen=True)
class Option:
    """One option: its kind, range, ``None``-ness and the options it excludes.

    Args:
        name: the keyword.
        kind: see the module docstring.
        minimum: the smallest legal value (``"int"`` / ``"number"``).
        maximum: the largest legal value.
        positive: ``> 0`` (``"number"``).
        choices: the legal values (``"choice"``).
        allow_none: ``None`` is legal.
        excludes: options that cannot be given together with this one (a value other than
            ``None``, ``False`` or the default counts as given).
        fix: the fix the message ends with.
        check: ``"custom"``: a function ``check(value)`` that raises.
        checked_in: ``"custom"`` without ``check``: where the check runs (before step 1).
        also: other types the option takes that its own code checks (a dict schedule).
        bad: values that must be refused, for the fuzz test (``"custom"`` options).
        example: a legal non-default value (to try excluded combinations).
        pointless: a legal value that does nothing useful, and the warning it gets (naming the
            fix): ``(value, "why. Fix: ...")``; the fuzz test calls each with it.
    """

    name: str
    kind: str
    minimum: float | None = None
    maximum: float | None = None
    positive: bool = False
    choices: tuple[Any, ...] = ()
    allow_none: bool = False
    excludes: tuple[str, ...] = ()
    fix: str | None = None
    check: Callable[[Any], object] | None = None
    checked_in: str | None = None
    also: tuple[type, ...] = ()
    bad: tuple[Any, ...] = ()
    example: Any = field(default=_NO_EXAMPLE, compare=False)
    pointless: tuple[Any, str] | None = None

    @property
    def has_example(self) -> bool:
        return self.example is not _NO_EXAMPLE

    def validate(self, value: Any) -> None:
        """Raise ``TypeError`` / ``ValueError`` if ``value`` is not legal for this option.

        Example:
            >>> Option("patience", "int", minimum=0).validate(-1)
            Traceback (most recent call last):
            ...
            ValueError: Expected `patience` >= 0. Received: patience=-1.
        """
        if (value is None and self.allow_none) or (self.also and isinstance(value, self.also)):
            return
        _CHECKS[self.kind](self, value)


def _int(o: Option, v: Any) -> None:
    check_int(o.name, v, int(o.minimum) if o.minimum is not None else -(2**63), fix=o.fix)
    _at_most(o, v)


def _number(o: Option, v: Any) -> None:
    check_number(o.name, v, positive=o.positive, minimum=o.minimum, fix=o.fix)
    _at_most(o, v)


def _at_most(o: Option, v: Any) -> None:
    if o.maximum is not None and v > o.maximum:
        expected = f"in [{o.minimum:g}, {o.maximum:g}]" if o.minimum is not None else f"<= {o.maximum:g}"
        raise ValueError(f"Expected `{o.name}` {expected}. Received: {o.name}={v!r}.{_fix(o)}")


def _bool(o: Option, v: Any) -> None:
    check_bool(o.name, v)


def _choice(o: Option, v: Any) -> None:
    if not any(_equal(v, c) and type(v) is not bool for c in o.choices):
        shown = [repr(c) for c in o.choices]
        valid = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"
        raise ValueError(f"Expected `{o.name}` to be {valid}. Received: {o.name}={v!r}.{_fix(o)}")


def _typed(what: str, ok: Callable[[Any], bool]) -> Callable[[Option, Any], None]:
    def check(o: Option, v: Any) -> None:
        if not ok(v):
            none = " or None" if o.allow_none else ""
            raise TypeError(
                f"Expected `{o.name}` to be {what}{none}. Received: {o.name}={v!r} ({type(v).__name__}).{_fix(o)}"
            )

    return check


def _custom(o: Option, v: Any) -> None:
    if o.check is not None:
        o.check(v)


def _fix(o: Option) -> str:
    return f" Fix: {o.fix}" if o.fix else ""


_CHECKS: dict[str, Callable[[Option, Any], None]] = {
    "int": _int,
    "number": _number,
    "bool": _bool,
    "choice": _choice,
    "custom": _custom,
    "text": _typed("a str", lambda v: isinstance(v, str)),
    "path": _typed("a str or a path", lambda v: isinstance(v, (str, os.PathLike))),
    "callable": _typed("a callable", callable),
}


class Table(dict[str, Option]):
    """The declared options of one function, by name; ``owner`` names the function."""

    owner: str


TABLES: dict[str, Table] = {}


def declare(owner: str, *options: Option, register: bool = True) -> Table:
    """A :class:`Table` of ``options``, registered in :data:`TABLES` under ``owner`` if ``register``.

    Example:
        >>> t = declare("doc.example", Option("patience", "int", minimum=0), register=False)
        >>> sorted(t), "doc.example" in TABLES
        (['patience'], False)
    """
    for o in options:
        if o.kind not in _CHECKS:
            raise ValueError(f"Unknown option kind {o.kind!r} for {owner}'s `{o.name}`.")
    table = Table((o.name, o) for o in options)
    table.owner = owner
    if register:
        TABLES[owner] = table
    return table


def _given(option: Option, value: Any, default: Any) -> bool:
    return value is not None and value is not False and not (value is default or _equal(value, default))


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an array compares element-wise
        return False


def check_options(table: Table, values: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> None:
    """Check ``values`` (name: value, the arguments a call was given) against ``table``.

    Each value is checked on its own first, then the excluded pairs among those given.

    Raises:
        TypeError: a value of the wrong type.
        ValueError: a value out of range, or two options that exclude each other.

    Example:
        >>> t = declare("doc", Option("a", "int", excludes=("b",)), Option("b", "int"), register=False)
        >>> check_options(t, {"a": 1, "b": 2})
        Traceback (most recent call last):
        ...
        ValueError: Expected at most one of `a` and `b`. Received: a=1, b=2. Fix: pass only `a` or only `b`.
    """
    defaults = defaults or {}
    for name, value in values.items():
        if name in table:
            table[name].validate(value)
            _warn_if_pointless(table, table[name], value)
    for name, option in table.items():
        for other in option.excludes:
            if (
                name in values
                and other in values
                and _given(option, values[name], defaults.get(name))
                and _given(table[other], values[other], defaults.get(other))
            ):
                raise ValueError(
                    f"Expected at most one of `{name}` and `{other}`. Received: {name}={values[name]!r}, "
                    f"{other}={values[other]!r}. Fix: pass only `{name}` or only `{other}`."
                )


def _warn_if_pointless(table: Table, option: Option, value: Any) -> None:
    if option.pointless is not None and _equal(value, option.pointless[0]) and type(value) is not bool:
        warnings.warn(f"{table.owner}({option.name}={value!r}): {option.pointless[1]}", FitkitWarning, stacklevel=4)


_F = TypeVar("_F", bound=Callable[..., Any])


def declared(table: Table) -> Callable[[_F], _F]:
    """Check the arguments of each call against ``table`` before the function runs.

    Only the arguments given are checked (defaults are legal by declaration); a call that does
    not bind (a missing argument) is left to the function's own error. The signature stays the
    function's own (``inspect.signature`` follows ``__wrapped__``).

    Example:
        >>> @declared(declare("doc", Option("n", "int", minimum=1), register=False))
        ... def f(n=1):
        ...     return n
        >>> f(n=0)
        Traceback (most recent call last):
        ...
        ValueError: Expected `n` >= 1. Received: n=0.
    """

    def wrap(function: _F) -> _F:
        signature = inspect.signature(function)
        defaults = {n: p.default for n, p in signature.parameters.items() if p.default is not p.empty}
        unknown = set(table) - set(signature.parameters)
        if unknown:
            raise ValueError(f"{table.owner} declares options its function does not take: {sorted(unknown)}.")

        @functools.wraps(function)
        def checked(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return function(*args, **kwargs)
            check_options(table, bound.arguments, defaults)
            return function(*args, **kwargs)

        checked.declared = table  # type: ignore[attr-defined]
        return cast(_F, checked)

    return wrap


def verbose_option(top: int = 1) -> Option:
    """A callback's ``verbose``: an int in ``[0, top]``."""
    return Option("verbose", "int", minimum=0, maximum=top)


def every_option(name: str, word: str = "epoch", unit: str = "batches") -> Option:
    """``word`` or a positive int of ``unit`` (``save_freq="epoch"`` or ``100``; :func:`check_every`)."""
    return Option(name, "custom", check=lambda v: check_every(name, v, word, unit), bad=(0, -1, "step", 1.5))


def mode_option() -> Option:
    """A monitoring callback's ``mode``: ``"auto"``, ``"min"`` or ``"max"`` (:func:`check_mode`)."""
    return Option("mode", "custom", check=check_mode, bad=("up", 1, None))
