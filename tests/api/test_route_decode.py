"""The fast route-body reader (app.api.route_decode, compiled app/api/_token_scan.pyx) answers every
body as the reference decoder does: the same request or the same refusal. Bodies are built
as text, so they include what a JSON library would never write: floats and exponents among
the ids, signs, leading zeros, whitespace, duplicate keys, `\\u`-escaped keys, values out
of range, too many ids, trailing bytes."""

from __future__ import annotations

import json
import re
from array import array
from typing import Any

import msgspec
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvroute.app.api import _token_scan, route_decode
from kvroute.app.api.route_decode import route_decoder
from kvroute.app.api.route_request import match_request_type
from kvroute.app.config import Settings
from kvroute.app.errors import RequestError

LIMIT = 6
SETTINGS = Settings(max_prompt_tokens=LIMIT)
FAST = route_decoder(SETTINGS, compiled=True)
REFERENCE = route_decoder(SETTINGS, compiled=False)
MATCH = match_request_type(SETTINGS)  # the route's question without `probe`, `all_scores`
FAST_MATCH = route_decoder(SETTINGS, compiled=True, kind=MATCH)
REFERENCE_MATCH = route_decoder(SETTINGS, compiled=False, kind=MATCH)

# Every digit count from 1 to 10 (the reader takes up to eight digits at once).
PLAIN_ID = st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 10**8 + 1),
                     st.integers(0, 999)).map(str)
ODD_ID = st.sampled_from(["-1", "-0", "01", "1.0", "3.5", "1e3", "2E1", "4294967296",
                          "99999999999", "true", "null", '"7"', "[1]", "{}", "1 2", ""])
SPACE = st.sampled_from(["", " ", "\n", "\t ", "\r\n  "])


@st.composite
def id_array(draw: st.DrawFn) -> str:
    ids = draw(st.lists(st.one_of(PLAIN_ID, PLAIN_ID, PLAIN_ID, ODD_ID), max_size=LIMIT + 2))
    parts = [draw(SPACE) + i + draw(SPACE) for i in ids]
    text = "[" + draw(SPACE) + ",".join(parts) + "]"
    if draw(st.booleans()) and draw(st.booleans()):
        text += draw(st.sampled_from([",", "]", "x", " ,"]))
    return text


OTHER_FIELD = st.sampled_from([
    '"probe": true', '"probe": 1', '"all_scores": false', '"model": "m"', '"model": 3',
    '"lora_name": null', '"candidates": ["a"]', '"candidates": []', '"unknown": 1',
    '"block_hashes": [1]', '"prompt": "hi"', '"token_ids": [5]', '"token_ids": [-5]',
    '"token_\\u0069ds": [-5]', '"model": "\\u00e9"', '"token_ids": null',
    # The key's name where it is not the top-level key: in a string, in a nested object,
    # as part of a longer name.
    '"model": "token_ids"', '"model": "\\"token_ids\\": [2]"', '"candidates": ["token_ids"]',
    '"messages": [{"role": "u", "token_ids": [1]}]', '"xtoken_ids": [1]',
    '"model": "token_ids\\":[1]"', '"lora_name": "\\"token_ids\\":[4]"'])


@st.composite
def body(draw: st.DrawFn) -> bytes:
    fields = draw(st.lists(OTHER_FIELD, max_size=3))
    if draw(st.integers(0, 9)):
        fields.insert(draw(st.integers(0, len(fields))),
                      f'"token_ids"{draw(SPACE)}:{draw(SPACE)}{draw(id_array())}')
    text = "{" + draw(SPACE) + ", ".join(fields) + draw(SPACE) + "}"
    if not draw(st.integers(0, 19)):
        text = draw(st.sampled_from(["", "[", "{", "null", "[1,2]", text[:-1], text + "x"]))
    return text.encode()


def outcome(decode: Any, payload: bytes) -> tuple[str, Any]:
    try:
        request = decode(payload)
    except RequestError as exc:
        return type(exc).__name__, exc.payload()
    fields = msgspec.structs.asdict(request)
    if fields["token_ids"] is not None:
        fields["token_ids"] = list(fields["token_ids"])
    return "request", fields


@settings(max_examples=1500, deadline=None)
@given(body())
@example(b'{"token_ids": [-5], "token_ids": null}')  # the last is null, the first refused
@example(b'{"token_\\u0069ds": [-5], "token_\\u0069ds": null}')
@example(b'{"messages": [{"role": "u", "token_ids": [1]}], "token_ids": null}')
@example(b'{"model": "\\"token_ids\\": [1]", "token_ids": [2]}')
@example(b'{"prompt": "token_ids", "token_ids": [2]}')
@example(b'{"messages": [{"role": "u", "token_ids": [1]}]}')
def test_the_fast_reader_answers_every_body_as_the_reference(payload: bytes) -> None:
    assert outcome(FAST, payload) == outcome(REFERENCE, payload)


@settings(max_examples=500, deadline=None)
@given(body())
@example(b'{"token_ids": [1], "probe": true}')  # a route's field: refused, by both
def test_the_fast_reader_answers_every_match_body_as_the_reference(payload: bytes) -> None:
    assert outcome(FAST_MATCH, payload) == outcome(REFERENCE_MATCH, payload)


def test_a_match_body_is_a_match_request() -> None:
    request = FAST_MATCH(b'{"token_ids": [3, 4], "model": "m"}')
    assert isinstance(request, MATCH) and list(request.token_ids) == [3, 4]
    assert not hasattr(request, "probe")


def test_a_key_spelled_elsewhere_is_not_taken_for_the_ids() -> None:
    """`token_ids` spelled once, but inside a message or a string: not the body's ids."""
    nested = b'{"messages": [{"role": "u", "token_ids": [1, 2]}], "model": "m"}'
    assert outcome(FAST, nested) == outcome(REFERENCE, nested)
    assert FAST(nested).token_ids is None and FAST(nested).messages == [
        {"role": "u", "token_ids": [1, 2]}]
    quoted = b'{"model": "\\"token_ids\\": [1]", "token_ids": [2, 3]}'
    assert list(FAST(quoted).token_ids) == [2, 3] and FAST(quoted).model == '"token_ids": [1]'


def test_plain_ids_are_read_into_uint32_arrays() -> None:
    """The common case takes the compiled path: the ids come back as array('I')."""
    assert route_decode.COMPILED_AVAILABLE  # `make test` builds it
    request = FAST(json.dumps({"token_ids": [0, 7, 2**32 - 1], "probe": True}).encode())
    assert isinstance(request.token_ids, array) and request.token_ids.typecode == "I"
    assert list(request.token_ids) == [0, 7, 2**32 - 1] and request.probe is True
    # Found by its key, so msgspec never walks the ids: the span is the array's text.
    body = b'{"probe": true, "token_ids" : [0, 7] }'
    ids, start, stop = _token_scan.scan_key(body, LIMIT)
    assert list(ids) == [0, 7] and body[start:stop] == b"[0, 7]"
    # The same body through the reference: a list of the same ints.
    assert REFERENCE(json.dumps({"token_ids": [0, 7, 2**32 - 1]}).encode()).token_ids == [
        0, 7, 2**32 - 1]


def test_refusals_keep_their_shape() -> None:
    """Too many ids, a negative id, an id of 3.0 (an integer to JSON Schema): as before."""
    too_many = json.dumps({"token_ids": list(range(LIMIT + 1))}).encode()
    assert outcome(FAST, too_many)[0] == "InvalidRequest"
    assert outcome(FAST, too_many) == outcome(REFERENCE, too_many)
    negative = b'{"token_ids": [1, -2]}'
    assert outcome(FAST, negative) == ("InvalidRequest", {
        "error": "Expected `int` >= 0 - at `$.token_ids[1]`", "field": "token_ids[1]"})
    assert outcome(FAST, b'{"token_ids": [3.0, 4]}') == outcome(REFERENCE, b'{"token_ids": [3, 4]}')


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 10**9),
                          st.integers(0, 99)), max_size=40),
       st.sampled_from([",", ", ", " ,\n", ",\t"]), st.sampled_from(["", "}", ' , "probe": 1}']))
def test_the_key_reader_reads_ids_of_every_length(ids: list[int], comma: str,
                                                   after: str) -> None:
    """Ids of one to ten digits, spelled with any JSON whitespace, up to the body's last
    bytes: read as JSON reads them (eight digits at a time where eight bytes remain)."""
    body = ('{"token_ids": [' + comma.join(map(str, ids)) + "]" + after).encode()
    found = _token_scan.scan_key(body, 64)
    assert found is not None
    assert list(found[0]) == ids and json.loads(body[found[1]:found[2]]) == ids


# A JSON array of plain ids: no sign, fraction, exponent or leading zero.
PLAIN_ARRAY = re.compile(r"\[[ \t\r\n]*(?:(?:0|[1-9][0-9]*)[ \t\r\n]*"
                         r"(?:,[ \t\r\n]*(?:0|[1-9][0-9]*)[ \t\r\n]*)*)?\]")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789-+.eE ,x]", min_size=1, max_size=14))
def test_the_key_reader_refuses_what_is_no_plain_id(spelled: str) -> None:
    """An id with a sign, a fraction, an exponent, a leading zero, over 2**32 - 1, or
    other bytes among its digits: never read as some other id. What is read is an array
    of plain ids, and the ids JSON reads in it."""
    body = ('{"token_ids": [' + spelled + ', 7]}').encode()
    found = _token_scan.scan_key(body, 64)
    if found is not None:
        ids, start, stop = found
        span = body[start:stop].decode()
        assert PLAIN_ARRAY.fullmatch(span)
        assert json.loads(span) == list(ids) and all(i < 2**32 for i in ids)
    elif PLAIN_ARRAY.fullmatch(body[14:-1].decode()):
        assert any(int(i) >= 2**32 for i in json.loads(body[14:-1]))  # too large: refused
