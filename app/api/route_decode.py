"""Decoding a `POST /v1/route` (or `/v1/match`) body without a Python int per token id.

The reference is `json_body.decode_json(body, route_request_type(settings))`: msgspec builds
the request with `token_ids` as a list of ints, which for a 32k-token prompt is most of a
route's time (tens of thousands of int objects, then copied again into the uint32 bytes the
index hashes). The fast reader reads the ids straight into an `array('I')` in compiled code
(`app/api/_token_scan.pyx`); the array is a sequence of ints to every caller, and its bytes are
the index's token bytes already (`index.keys.token_bytes`). It finds them one of two ways:
- first where the body spells its only `"token_ids":` (`scan_key`); msgspec then decodes
  the body with that array replaced by `null`, so it never walks the ids at all, and the
  ids are taken only if the top-level `token_ids` msgspec finds is that very `null`
  (`decoded_at`: the same bytes in memory), not a nested key or a key inside a string;
- else msgspec decodes the body with `token_ids` left as raw JSON (`msgspec.Raw`) and the
  compiled code reads that raw text (`scan`).

Invariant: on every body, the fast reader answers what the reference answers (the same
request, or the same refusal). It only takes bodies it can read exactly; anything else goes
to the reference decoder:
- the other fields are decoded by msgspec with the same types and limits, and any refusal
  there (or in the JSON itself) is left to the reference, which reports it as it always has;
- the ids must be plain unsigned decimal integers below 2**32, at most `max_prompt_tokens`
  of them (`3.0`, `1e3`, a sign, a string, too many: the reference decides);
- the body must name `token_ids` once and hold no backslash outside the ids: with a
  duplicate key the reference would check every occurrence, the raw reader only the last,
  and a key spelled with an escape could hide a duplicate. A body whose `token_ids` ends
  up null or absent takes the fast reader only if it never spells the key and holds no
  `\\u` escape (the only escape that can spell a letter of it).
The reader is compiled with the index and used where the index runs compiled
(``kvroute.index.IMPLEMENTATION``): ``KVROUTE_PURE=1`` selects the reference here too, and so
does an install without the compiled reader.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import TypeVar

import msgspec

from kvroute.app.api.json_body import decode_json
from kvroute.app.api.route_request import MatchRequest, route_request_type
from kvroute.app.config import Settings
from kvroute.index.prefix_index import IMPLEMENTATION

try:  # compiled at install time when a C compiler is there (like index/_fast.pyx)
    from kvroute.app.api._token_scan import decoded_at, scan, scan_key
except ImportError:
    decoded_at = scan = scan_key = None

__all__ = ["COMPILED_AVAILABLE", "route_decoder"]

#: Whether the compiled token-id reader is importable.
COMPILED_AVAILABLE = scan is not None
_NULL = msgspec.Raw(b"null")
R = TypeVar("R", bound=MatchRequest)


def route_decoder(settings: Settings, *, compiled: bool | None = None,
                  kind: type[R] | None = None) -> Callable[[bytes], R]:
    """How POST /v1/route reads a body under `settings` (or, given `kind`, a body of that
    request type, e.g. `match_request_type(settings)` for POST /v1/match); refusals are
    RequestErrors. `compiled`: use the fast reader (default: when built and not switched
    off)."""
    if kind is None:
        kind = route_request_type(settings)
    if compiled is None:
        compiled = COMPILED_AVAILABLE and IMPLEMENTATION == "compiled"
    if not compiled or scan is None or scan_key is None or decoded_at is None:
        return lambda body: decode_json(body, kind)
    raw_kind = _raw_tokens(kind)
    lean_decoder = msgspec.json.Decoder(raw_kind)
    names = [name for name in kind.__struct_fields__ if name != "token_ids"]
    limit = settings.max_prompt_tokens
    read, read_key, exactly_at = scan, scan_key, decoded_at

    def decode(body: bytes) -> R:
        found = read_key(body, limit)
        if found is not None:
            # The ids read where the body spells its only `token_ids`; msgspec decodes the
            # rest with `null` in their place, and they are the body's if the top-level
            # `token_ids` it finds is that very `null` (not a nested or absent key).
            ids, start, stop = found
            rest = body[:start] + b"null" + body[stop:]
            try:
                lean = lean_decoder.decode(rest)
            except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
                return decode_json(body, kind)  # refused: the reference says how
            if exactly_at(rest, lean.token_ids, start):
                return kind(token_ids=ids, **{name: getattr(lean, name) for name in names})
        try:
            lean = lean_decoder.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            return decode_json(body, kind)  # refused: the reference says how
        raw = lean.token_ids
        if raw == _NULL:
            # No token_ids, or null: read as the reference would unless the body may name
            # the key more than once (an earlier, invalid value the reference would refuse).
            if b"token_ids" in body or b"\\u" in body:
                return decode_json(body, kind)
            ids = None
        else:
            ids = read(body, raw, limit)
            if ids is None:
                return decode_json(body, kind)
        return kind(token_ids=ids, **{name: getattr(lean, name) for name in names})

    return decode


@cache
def _raw_tokens(kind: type[R]) -> type[R]:
    """`kind` with `token_ids` kept as the raw JSON text of its value (`null` if absent)."""
    return msgspec.defstruct(f"{kind.__name__}RawTokens",
                             [("token_ids", msgspec.Raw, _NULL)],
                             bases=(kind,), forbid_unknown_fields=True, module=__name__)
