"""Fields declared once, with their types and bounds (`msgspec.Meta`), checked alike whether a
Struct comes from a decoded file (`msgspec.convert`) or from Python keyword arguments
(`conform` in its `__post_init__`), with errors in a configuration author's words that name
the field and the bound."""

from __future__ import annotations

import enum
import re
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import msgspec

from omni_core.engine.errors import InvalidArgumentError

_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
# msgspec names JSON types; a configuration's author reads TOML and Python.
_WORDS = {
    "`int`": "an integer",
    "`float`": "a number",
    "`str`": "a string",
    "`bool`": "true or false",
    "`array`": "a list",
    "`object`": "a table",
    "`null`": "nothing",
}


class FieldError(InvalidArgumentError):
    """A field of a spec is refused: `field` is its path ('ranks', 'placement.num_gpus',
    'tags[1]'; None: the table as a whole), `detail` what is wrong with it."""

    def __init__(self, what: str, field: str | None, detail: str) -> None:
        super().__init__(f"{what}: field {field!r}: {detail}" if field else f"{what}: {detail}")
        self.field, self.detail = field, detail


def validation_words(exc: msgspec.ValidationError, cls: Any) -> tuple[str, str | None]:
    """What msgspec refused while converting a value to type `cls`, in a configuration
    author's words (TOML and Python, not JSON), and the path of the field it names inside
    that value, or None for the value as a whole."""
    message, path = str(exc), None
    found = _AT.search(message)
    if found:
        message, path = message[: found.start()], found.group("path").lstrip(".") or None
    cause = exc.__cause__
    if isinstance(cause, FieldError):  # raised by a __post_init__, about its own fields
        field = ".".join(p for p in (path, cause.field) if p) or None
        return cause.detail, field
    named = re.search(r"(unknown|missing required) field `([^`]+)`", message)
    if named:
        field = ".".join(p for p in (path, named.group(2)) if p)
        if named.group(1) == "unknown":
            known = sorted(getattr(_hint_at(cls, path), "__struct_fields__", ()))
            return f"unknown field; known fields: {known}", field
        return "missing, and it has no default: give it", field
    if message.startswith("Invalid enum value"):
        hint = _hint_at(cls, path)
        if get_origin(hint) is Literal:
            return f"must be one of {list(get_args(hint))}", path
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return f"must be one of {[m.value for m in hint]}", path
    for name, words in _WORDS.items():
        message = message.replace(name, words)
    return message[:1].lower() + message[1:], path


def conform(struct: msgspec.Struct, what: str) -> None:
    """Convert each field of `struct` to its declared type in place and check its bounds, so
    an object built in Python meets what a decoded file meets: lists become tuples, strings
    of an enum its members, and a value out of bounds is refused naming the field and the
    bound."""
    for name, hint in _hints(type(struct)).items():
        value = getattr(struct, name)
        try:
            converted = msgspec.convert(value, hint)
        except msgspec.ValidationError as exc:
            detail, inner = validation_words(exc, hint)
            field = name + ("." + inner if inner and not inner.startswith("[") else inner or "")
            got = "" if ", got " in detail else f", got {value!r}"
            raise FieldError(what, field, detail + got) from None
        if converted is not value:
            msgspec.structs.force_setattr(struct, name, converted)


def _unwrap(hint: Any) -> Any:
    """The type inside Annotated[...] and `X | None`."""
    while True:
        if get_origin(hint) is Annotated:
            hint = get_args(hint)[0]
        elif get_origin(hint) in (Union, UnionType):
            rest = [h for h in get_args(hint) if h is not type(None)]
            if len(rest) != 1:
                return hint
            hint = rest[0]
        else:
            return hint


def _hint_at(cls: Any, path: str | None) -> Any:
    """The declared type of the field at dotted `path` inside type `cls` (None: `cls`)."""
    hint: Any = _unwrap(cls)
    for part in (path or "").split("."):
        name = part.split("[", 1)[0]
        if not name:
            continue
        fields = _hints(hint) if isinstance(hint, type) and hasattr(hint, "__struct_fields__") else {}
        if name not in fields:
            return None
        hint = _unwrap(fields[name])
    return _unwrap(hint)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        hints = get_type_hints(cls, include_extras=True)
        _HINTS[cls] = {name: hints[name] for name in cls.__struct_fields__}  # type: ignore[attr-defined]
    return _HINTS[cls]
