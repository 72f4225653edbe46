"""The string rules of kvroute's request fields, each written once as a regex.

Each regex both checks a value (`matches`, a full match in Python) and describes the
field in the OpenAPI document (a JSON Schema `pattern`, which ECMA-262 evaluates). So
they are written in the subset where the two engines agree: explicit ASCII character
classes instead of `\\s`/`\\S`/`\\d` (whose Unicode meanings differ), no lookaround, no
inline flags. A pattern is anchored with `^...$`; `matches` uses `fullmatch`, because
Python's `$` also matches before a final newline and ECMA-262's does not.

`parse_endpoint` and `format_endpoint` are the one spelling of an `IP:PORT` endpoint (what
a gateway is told to connect to), for configuration and the Endpoint Picker alike.
"""

from __future__ import annotations

import ipaddress
import re
from functools import cache
from typing import Annotated, Any

import msgspec

__all__ = [
    "API_KEY", "BLOCK_HASH_HEX", "HTTP_ORIGIN", "INSTANCE_ID", "IP_ENDPOINT", "NOT_BLANK",
    "ZMQ_ENDPOINT",
    "described", "documented", "format_endpoint", "matches", "parse_endpoint",
]

# Contains something besides ASCII whitespace (unanchored: a `search`, in both engines).
NOT_BLANK = r"[^\t\n\v\f\r ]"

_PORT = (r"0*(?:[1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]"
         r"|6553[0-5])")  # 1 to 65535
_H16 = r"[0-9A-Fa-f]{1,4}"
# Every textual form of an IPv6 address (RFC 4291 2.2) but the ones ending in IPv4 digits.
_IPV6 = "|".join([
    rf"(?:{_H16}:){{7}}{_H16}",
    rf"(?:{_H16}:){{1,7}}:",
    rf"(?:{_H16}:){{1,6}}:{_H16}",
    rf"(?:{_H16}:){{1,5}}(?::{_H16}){{1,2}}",
    rf"(?:{_H16}:){{1,4}}(?::{_H16}){{1,3}}",
    rf"(?:{_H16}:){{1,3}}(?::{_H16}){{1,4}}",
    rf"(?:{_H16}:){{1,2}}(?::{_H16}){{1,5}}",
    rf"{_H16}:(?::{_H16}){{1,6}}",
    rf":(?:(?::{_H16}){{1,7}}|:)",
])
# A DNS name or IPv4 address, as libzmq connects to one (it refuses a name that does not
# begin with a letter or digit, or that has a character besides those and "._-"), or a
# bracketed IPv6 address.
_HOST = rf"(?:[A-Za-z0-9][A-Za-z0-9._-]*|\[(?:{_IPV6})\])"

# An instance's HTTP origin: http(s)://HOST[:PORT], any letter case in the scheme, trailing
# slashes allowed; no path, query, fragment or credentials.
HTTP_ORIGIN = rf"^[hH][tT][tT][pP][sS]?://{_HOST}(?::{_PORT})?/*$"
_IPV4_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"  # no leading zeros, as ipaddress
# An address a gateway connects to without resolving a name: IPv4 or bracketed IPv6, a port.
IP_ENDPOINT = rf"^(?:{_IPV4_OCTET}(?:\.{_IPV4_OCTET}){{3}}|\[(?:{_IPV6})\]):{_PORT}$"
# A ZeroMQ endpoint to connect to.
ZMQ_ENDPOINT = rf"^tcp://{_HOST}:{_PORT}$"
# An instance id names it in URLs, logs, metric labels and the proxy's x-kvroute-instance
# header, whose value must be ASCII: printable ASCII but '/', no space at either end.
INSTANCE_ID = r"^[!-.0-~](?:[ -.0-~]*[!-.0-~])?$"
# An instance's vLLM --api-key goes into an Authorization header: printable ASCII, no space at
# either end (a header value loses those).
API_KEY = r"^[!-~](?:[ -~]*[!-~])?$"
# vLLM's block hash as a hex string: an integer hash (up to 16 digits) or a bytes hash (32
# or 64 digits), with an optional 0x.
BLOCK_HASH_HEX = r"^(?:0x)?(?:[0-9a-fA-F]{1,16}|[0-9a-fA-F]{32}|[0-9a-fA-F]{64})$"


@cache
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def matches(pattern: str, value: str) -> bool:
    """Whether `value` is what `pattern` describes, as a JSON Schema validator decides."""
    return _compiled(pattern).fullmatch(value) is not None


def described(kind: Any, pattern: str) -> Any:
    """`kind` (str) with `pattern` in its JSON Schema; the code that reads the field checks
    it with `matches` (msgspec's own `pattern` uses `re.search`, see the module doc)."""
    return Annotated[kind, msgspec.Meta(extra_json_schema={"pattern": pattern})]


def documented(kind: Any, description: str) -> Any:
    """`kind` with a description for people in its JSON Schema (a field of a request)."""
    return Annotated[kind, msgspec.Meta(description=description)]


def format_endpoint(address: str, port: int) -> str:
    """`1.2.3.4:80` or `[fd00::1]:80` (the address in its compressed form)."""
    ip = ipaddress.ip_address(address)
    return f"[{ip.compressed}]:{port}" if ip.version == 6 else f"{ip.compressed}:{port}"


def parse_endpoint(text: str) -> str | None:
    """`text` as a normalized IP:PORT (IPv6 in brackets), or None when it is not one."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        return None
    if (ip.version == 6) != bracketed:
        return None
    return format_endpoint(ip.compressed, int(port))
