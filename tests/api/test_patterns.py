"""The request fields' patterns (app.patterns) mean the same to the service as to a JSON
Schema validator, and everything a pattern admits the service accepts.

The schema side is jsonschema_rs (ECMA-262 regexes: what schemathesis and most validators
use); the service side is `patterns.matches` and the structs that check with it.
"""

from __future__ import annotations

import ipaddress
import re

import jsonschema_rs
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.app import patterns
from kvroute.app.api.route_request import parse_hash
from kvroute.app.config import InstanceConfig

PATTERNS = {
    "HTTP_ORIGIN": patterns.HTTP_ORIGIN,
    "ZMQ_ENDPOINT": patterns.ZMQ_ENDPOINT,
    "INSTANCE_ID": patterns.INSTANCE_ID,
    "BLOCK_HASH_HEX": patterns.BLOCK_HASH_HEX,
    "API_KEY": patterns.API_KEY,
    "IP_ENDPOINT": patterns.IP_ENDPOINT,
}
MANY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def drawn(pattern: str) -> st.SearchStrategy[str]:
    """Strings the pattern admits, near misses (a final newline, a space in front, one
    character cut), and anything at all."""
    admitted = st.from_regex(re.compile(pattern), fullmatch=True)
    return (admitted | admitted.map(lambda s: s + "\n") | admitted.map(lambda s: " " + s)
            | admitted.map(lambda s: s[:-1]) | st.text(max_size=40))


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_the_service_and_a_json_schema_validator_agree(name: str):
    pattern = PATTERNS[name]
    validator = jsonschema_rs.validator_for({"type": "string", "pattern": pattern})

    @MANY
    @given(drawn(pattern))
    def agree(value: str) -> None:
        assert patterns.matches(pattern, value) == validator.is_valid(value), value

    agree()


def test_the_not_blank_rule_agrees_too():
    validator = jsonschema_rs.validator_for({"type": "string", "pattern": patterns.NOT_BLANK})
    for value in ("", " ", "\t\n", "\x1c", "\ufeff", "\u3000", " a ", "a"):
        python = re.search(patterns.NOT_BLANK, value) is not None
        assert python == validator.is_valid(value), repr(value)


@MANY
@given(st.from_regex(re.compile(patterns.HTTP_ORIGIN), fullmatch=True))
def test_every_admitted_url_is_accepted_as_an_origin(url: str):
    config = msgspec.convert({"url": url}, InstanceConfig)
    assert config.url is not None and config.url.startswith(("http://", "https://"))
    assert not config.url.endswith("/")


@MANY
@given(st.from_regex(re.compile(patterns.ZMQ_ENDPOINT), fullmatch=True))
def test_every_admitted_endpoint_is_accepted_unless_it_is_a_bind_address(endpoint: str):
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    try:
        config = msgspec.convert({"events": endpoint}, InstanceConfig)
    except msgspec.ValidationError as exc:
        assert host in ("0.0.0.0", "::") and "bind address" in str(exc)
    else:
        assert config.events == (endpoint,)


@MANY
@given(st.from_regex(re.compile(patterns.ZMQ_ENDPOINT), fullmatch=True))
def test_zeromq_connects_to_every_admitted_endpoint(endpoint: str):
    """libzmq refuses some names outright (one beginning with '.', '-' or '_'); registering
    one made the subscriber task die and a later DELETE answer 500."""
    context = zmq.Context.instance()
    socket = context.socket(zmq.SUB)
    try:
        socket.connect(endpoint)
    finally:
        socket.close(0)


@MANY
@given(st.from_regex(re.compile(patterns.INSTANCE_ID), fullmatch=True))
def test_every_admitted_id_is_accepted(instance_id: str):
    assert msgspec.convert({"url": "http://h:1", "id": instance_id}, InstanceConfig).id


@MANY
@given(st.from_regex(re.compile(patterns.IP_ENDPOINT), fullmatch=True))
def test_every_admitted_gateway_endpoint_is_accepted(endpoint: str):
    config = msgspec.convert({"url": "http://h:1", "endpoint": endpoint}, InstanceConfig)
    assert config.endpoint is not None and config.endpoint == patterns.parse_endpoint(endpoint)


@MANY
@given(st.from_regex(re.compile(patterns.BLOCK_HASH_HEX), fullmatch=True))
def test_every_admitted_hex_hash_is_parsed(value: str):
    parsed = parse_hash(value, 0)
    digits = value.removeprefix("0x")
    assert parsed == (int(digits, 16) if len(digits) <= 16 else bytes.fromhex(digits))


@MANY
@given(st.from_regex(re.compile(f"^(?:{patterns._IPV6})$"), fullmatch=True))
def test_the_ipv6_form_admits_only_addresses(address: str):
    ipaddress.IPv6Address(address)


@pytest.mark.parametrize("address", ["::", "::1", "fe80::1", "2001:db8::8a2e:370:7334",
                                     "1:2:3:4:5:6:7:8", "1::8", "1:2:3:4:5:6:7::"])
def test_the_ipv6_form_admits_the_usual_spellings(address: str):
    assert patterns.matches(patterns.HTTP_ORIGIN, f"http://[{address}]:8000")


@pytest.mark.parametrize(("pattern", "value", "admitted"), [
    (patterns.HTTP_ORIGIN, "http://10.0.0.5:8000", True),
    (patterns.HTTP_ORIGIN, "HTTPS://vllm-0.vllm:8000//", True),
    (patterns.HTTP_ORIGIN, "http://h:0", False),
    (patterns.HTTP_ORIGIN, "http://h:65536", False),
    (patterns.HTTP_ORIGIN, "http://u:p@h:1", False),
    (patterns.HTTP_ORIGIN, "http://h:1/v1", False),
    (patterns.HTTP_ORIGIN, "http://[::1", False),
    (patterns.HTTP_ORIGIN, " http://h:1", False),
    (patterns.ZMQ_ENDPOINT, "tcp://10.0.0.5:5557", True),
    (patterns.ZMQ_ENDPOINT, "tcp://[::1]:5557", True),
    (patterns.ZMQ_ENDPOINT, "tcp://*:5557", False),
    (patterns.ZMQ_ENDPOINT, "tcp://.s.CCF:65531", False),  # found by the fuzz test
    (patterns.ZMQ_ENDPOINT, "tcp://-a:1", False),
    (patterns.ZMQ_ENDPOINT, "tcp://_a:1", False),
    (patterns.ZMQ_ENDPOINT, "tcp://a~b:1", False),
    (patterns.ZMQ_ENDPOINT, "tcp://a_b-c.:000065531", True),
    (patterns.ZMQ_ENDPOINT, "tcp://h:\u0661", False),  # a digit, but not an ASCII one
    (patterns.INSTANCE_ID, "gpu-b", True),
    (patterns.INSTANCE_ID, "[::1]:9", True),
    (patterns.INSTANCE_ID, "a b", True),
    (patterns.INSTANCE_ID, " a", False),
    (patterns.INSTANCE_ID, "a/b", False),
    (patterns.INSTANCE_ID, "a\x85b", False),
    (patterns.INSTANCE_ID, "I\u0126", False),  # not ASCII: it goes into a header
    (patterns.IP_ENDPOINT, "10.0.0.5:8000", True),
    (patterns.IP_ENDPOINT, "[fd00::1]:8000", True),
    (patterns.IP_ENDPOINT, "256.0.0.1:8000", False),
    (patterns.IP_ENDPOINT, "010.0.0.5:8000", False),  # ipaddress refuses leading zeros
    (patterns.IP_ENDPOINT, "fd00::1:8000", False),  # IPv6 needs its brackets
    (patterns.IP_ENDPOINT, "vllm-0:8000", False),  # a gateway does not resolve names
    (patterns.IP_ENDPOINT, "10.0.0.5:0", False),
    (patterns.API_KEY, "sk-abc/+=", True),
    (patterns.API_KEY, "k\u00e9", False),
    (patterns.INSTANCE_ID, "a\n", False),
    (patterns.BLOCK_HASH_HEX, "0x" + "f" * 16, True),
    (patterns.BLOCK_HASH_HEX, "f" * 17, False),
    (patterns.BLOCK_HASH_HEX, "f" * 64, True),
])
def test_examples(pattern: str, value: str, admitted: bool):
    assert patterns.matches(pattern, value) == admitted
