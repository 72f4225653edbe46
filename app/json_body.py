"""Decoding a JSON request body, with every way it can be wrong turned into a refusal.

msgspec reports bad input in four ways: `ValidationError` (JSON of the wrong shape),
`DecodeError` (not JSON), `UnicodeDecodeError` (invalid UTF-8 inside a string) and
`RecursionError` (nesting deeper than the interpreter's stack). The last two are not
`DecodeError`s; left uncaught they were 500s.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from kvroute.app.errors import InvalidRequest, MalformedRequest

__all__ = ["decode_json", "field_of", "split_validation"]

T = TypeVar("T")


def decode_json(body: bytes, type: type[T] | Any = Any) -> T:
    """`body` decoded as `type`; MalformedRequest if it is not JSON, InvalidRequest (naming
    the field) if it is JSON of the wrong shape."""
    try:
        return msgspec.json.decode(body, type=type)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(str(exc), field_of(str(exc))) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise MalformedRequest(f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise MalformedRequest("body is not valid JSON: nested too deeply") from None


def split_validation(message: str) -> tuple[str, str]:
    """msgspec's `Expected `int` - at `$.token_ids[3]`` as (`Expected `int``,
    `token_ids[3]`); the path is empty for the document itself."""
    text, found, path = message.rpartition(" - at `")
    if not found:
        return message, ""
    return text, path.rstrip("`").removeprefix("$").removeprefix(".")


def field_of(validation_message: str) -> str | None:
    """`... - at `$.token_ids[3]`` -> `token_ids[3]`; unknown and missing fields of the
    document itself name themselves."""
    text, path = split_validation(validation_message)
    if path:
        return path
    found = re.search(r"(?:unknown|missing required) field `([^`]*)`", text)
    return found.group(1) if found else None
