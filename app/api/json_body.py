"""Decoding a JSON request body, with every way it can be wrong turned into a refusal.

msgspec reports bad input in four ways: `ValidationError` (JSON of the wrong shape),
`DecodeError` (not JSON), `UnicodeDecodeError` (invalid UTF-8 inside a string) and
`RecursionError` (nesting deeper than the interpreter's stack). The last two are not
`DecodeError`s; left uncaught they were 500s.

A number with a zero fractional part (`3.0`, `1e3`) is an integer to JSON Schema, so the
OpenAPI document allows it wherever it allows an integer. msgspec refuses a float for an
`int`; a body it refuses for that is decoded again with such numbers read as integers
(`integral_numbers`). Bodies of ordinary integers never take that path.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from kvroute.app.errors import InvalidRequest, MalformedRequest, split_validation

__all__ = ["decode_json", "field_of", "integral_numbers"]

T = TypeVar("T")


def decode_json(body: bytes, type: type[T] | Any = Any) -> T:
    """`body` decoded as `type`; MalformedRequest if it is not JSON, InvalidRequest (naming
    the field) if it is JSON of the wrong shape."""
    try:
        try:
            return msgspec.json.decode(body, type=type)
        except msgspec.ValidationError as exc:
            if "got `float`" not in str(exc):
                raise
            # Read again with integral numbers as ints; the rest of the body has not been
            # read yet, so it may still turn out not to be JSON.
            return msgspec.convert(integral_numbers(msgspec.json.decode(body)), type)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(str(exc), field_of(str(exc))) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise MalformedRequest(f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise MalformedRequest("body is not valid JSON: nested too deeply") from None


def integral_numbers(value: Any) -> Any:
    """`value` (decoded JSON) with every float that has a zero fractional part made an int,
    at any depth; changed in place where it is a list or a dict."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    pending = [value] if isinstance(value, list | dict) else []
    while pending:  # iterative: JSON may nest deeper than the interpreter's stack
        container = pending.pop()
        keys = list(container) if isinstance(container, dict) else range(len(container))
        for key in keys:
            item = container[key]
            if isinstance(item, float) and item.is_integer():
                container[key] = int(item)
            elif isinstance(item, list | dict):
                pending.append(item)
    return value


def field_of(validation_message: str) -> str | None:
    """`... - at `$.token_ids[3]`` -> `token_ids[3]`; unknown and missing fields of the
    document itself name themselves."""
    text, path = split_validation(validation_message)
    if path:
        return path
    found = re.search(r"(?:unknown|missing required) field `([^`]*)`", text)
    return found.group(1) if found else None
