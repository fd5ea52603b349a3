"""The JSON shape of each API's body: the type of every field the server reads, checked before any
parser looks at it, so that no parser meets a list where it expects a string (a TypeError in a
membership test or an attribute access, once a 500) and the next field added is covered by adding it
here. Only types: ranges, lengths and meanings are the parsers' (with their own messages).

    check(body, SHAPE, style)   400 naming the first field whose type is wrong (message and `param`),
                                in the API's own path style: messages[0].content[1].text (OpenAI),
                                messages.0.content.1.text (Anthropic)

A field set to null is unset wherever it stands in an object (what clients send for "not given"); a
null item of a list is a wrong type. Fields an object's shape does not name are not checked (they are
named in X-Strata-Ignored, or belong to a kind of part or tool that is left out); a shape names only
what a parser reads. The walk is iterative: no body can exhaust the stack (depth is bounded earlier).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import bad_request

Style = Literal["openai", "anthropic"]


class Shape:
    """A JSON type: `accepts` a value of it; `describe` says it in an error message."""

    __slots__ = ()

    def describe(self) -> str:
        raise NotImplementedError

    def accepts(self, value: Any) -> bool:
        raise NotImplementedError


class _Any(Shape):
    __slots__ = ()

    def describe(self) -> str:
        return "a value"

    def accepts(self, value: Any) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class _Scalar(Shape):
    label: str
    kinds: tuple[type, ...]

    def describe(self) -> str:
        return self.label

    def accepts(self, value: Any) -> bool:
        return isinstance(value, self.kinds) and not (isinstance(value, bool) and bool not in self.kinds)


STR = _Scalar("a string", (str,))
INT = _Scalar("an integer", (int,))
NUM = _Scalar("a number", (int, float))
BOOL = _Scalar("true or false", (bool,))
ANY = _Any()  # read as it is (any JSON)
OBJECT = _Scalar("an object", (dict,))  # any object, its fields unchecked (metadata, schemas)


@dataclass(frozen=True, slots=True)
class Obj(Shape):
    """An object; `fields` are checked (null ones skipped), the others are not."""

    fields: Mapping[str, Shape] = field(default_factory=dict)
    values: Shape = ANY  # the shape of every field not named (a map of strings, say)

    def describe(self) -> str:
        return "an object"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, dict)


@dataclass(frozen=True, slots=True)
class List(Shape):
    item: Shape = ANY

    def describe(self) -> str:
        return "an array"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, list)


@dataclass(frozen=True, slots=True)
class Either(Shape):
    """The first of `shapes` whose outer type the value has (a string, or an array of parts)."""

    shapes: tuple[Shape, ...]

    def describe(self) -> str:
        return " or ".join(shape.describe() for shape in self.shapes)

    def accepts(self, value: Any) -> bool:
        return any(shape.accepts(value) for shape in self.shapes)

    def chosen(self, value: Any) -> Shape:
        return next(shape for shape in self.shapes if shape.accepts(value))


@dataclass(frozen=True, slots=True)
class Tagged(Shape):
    """An object whose `key` (a string) picks its shape; other kinds get `other` (their fields left to
    the parser that leaves them out). A missing key is the kind `missing`, when given."""

    kinds: Mapping[str, Obj]
    key: str = "type"
    missing: str | None = None
    other: Obj = Obj()

    def describe(self) -> str:
        return "an object"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, dict)


@dataclass(frozen=True, slots=True)
class Checked:
    """A request body's shape: the fields of its top level, and the error code of a top-level field of
    the wrong type (invalid_type unless named; a value inside one is invalid_type)."""

    body: Obj
    codes: Mapping[str, str] = field(default_factory=dict)


def check(body: dict[str, Any], shape: Checked, style: Style) -> None:
    """400 (the field's path; the code of its top-level field) at the first value of a wrong type."""
    pending: list[tuple[Any, Shape, tuple]] = [(body, shape.body, ())]
    while pending:
        value, expected, path = pending.pop()
        if not expected.accepts(value):
            raise _wrong(value, expected, path, shape, style)
        if isinstance(expected, Either):
            pending.append((value, expected.chosen(value), path))
        elif isinstance(expected, Tagged):
            pending.append((value, _kind(value, expected, path, shape, style), path))
        elif isinstance(expected, Obj):  # pushed last first: the first wrong field is the one named
            named = [(key, item) for key, item in value.items() if item is not None]
            pending.extend(
                (item, expected.fields.get(key, expected.values), (*path, key)) for key, item in reversed(named)
            )
        elif isinstance(expected, List):
            pending.extend((value[i], expected.item, (*path, i)) for i in reversed(range(len(value))))


def _kind(value: dict, expected: Tagged, path: tuple, shape: Checked, style: Style) -> Obj:
    kind = value.get(expected.key, expected.missing)
    if not isinstance(kind, str):
        raise _wrong(kind, STR, (*path, expected.key), shape, style)
    return expected.kinds.get(kind, expected.other)


def _wrong(value: Any, expected: Shape, path: tuple, shape: Checked, style: Style):
    where = _path(path, style)
    code = shape.codes.get(str(path[0]), "invalid_type") if len(path) == 1 else "invalid_type"
    return bad_request(f"{where or 'the body'}: must be {expected.describe()}; got {_json_type(value)}", code, where)


def _path(path: tuple, style: Style) -> str:
    out = ""
    for step in path:
        if isinstance(step, int):
            out += f".{step}" if style == "anthropic" else f"[{step}]"
        else:
            out += f".{_shown(step)}" if out else _shown(step)
    return out


def _shown(key: str) -> str:
    return key if len(key) <= 64 and key.isprintable() else key[:64].encode("unicode_escape").decode() + "..."


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {str: "a string", int: "a number", float: "a number", list: "an array", dict: "an object"}.get(
        type(value), type(value).__name__
    )
