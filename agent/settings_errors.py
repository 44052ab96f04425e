"""A pydantic validation error of the settings told in one line, as flags and config files
spell the setting: ``debounce: expected float, got str 'soon'``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

# pydantic's error types -> the type they expected, named as in YAML/JSON documents
_EXPECTED = {"float_parsing": "float", "float_type": "float", "int_parsing": "int", "int_type": "int",
             "int_from_float": "int", "bool_parsing": "bool", "bool_type": "bool", "string_type": "str",
             "dict_type": "object", "list_type": "array", "tuple_type": "array"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    return type(value).__name__


def error_message(err: ValidationError, model: type[BaseModel]) -> str:
    """The first error as ``debounce: expected float, got str 'soon'``: the setting's name as
    flags spell it, then what is wrong with its value."""
    e = err.errors(include_url=False)[0]
    name, kind, given = str(e["loc"][0]) if e["loc"] else "", e["type"], e.get("input")
    setting = ".".join([name.replace("_", "-"), *(x for x in e["loc"][1:] if isinstance(x, str))])  # a nested key too
    if kind == "extra_forbidden":
        return f"{setting}: no such setting"
    if kind == "value_error":  # one of the settings' own checks: its message as it is
        return f"{setting}: {e['ctx']['error']}"
    if kind == "literal_error":
        return f"{setting}: invalid enum value {given!r}"[:200]
    if kind in _EXPECTED:
        expected = _EXPECTED[kind]
        field = model.model_fields.get(name)
        if len(e["loc"]) == 1 and field is not None and not field.is_required() and _nullable(field.annotation):
            expected += " | null"
        shown = f" {given!r}"[:80] if isinstance(given, str) else ""
        return f"{setting}: expected {expected}, got {_json_type(given)}{shown}"
    return f"{setting}: {e['msg']}"


def _nullable(annotation: Any) -> bool:
    return type(None) in getattr(annotation, "__args__", ())
