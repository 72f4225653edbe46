"""The Endpoint Picker's parts on their own: endpoints, withdrawing one guess, moving a
ticket, its TLS identity and its settings. (The protocol itself: tests/epp/test_protocol.py.)"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trustme
from cryptography import x509

from kvroute.app.cli import _parser
from kvroute.app.config import ConfigError, InstanceConfig, load_settings, parse_instance
from kvroute.app.epp.tls import load_identity, self_signed
from kvroute.app.fleet.endpoints import EndpointMap
from kvroute.app.fleet.registry import Instance
from kvroute.app.patterns import format_endpoint, parse_endpoint
from kvroute.app.pem import check_pem_files
from kvroute.app.routing.inflight import InFlight
from kvroute.index import PrefixIndex
from kvroute.index.placement import Placements, chain_keys
from tests.support.waiting import run_async, scaled

# --- endpoints ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "normalized"), [
    ("10.0.0.5:8000", "10.0.0.5:8000"),
    (" 10.0.0.5:8000 ", "10.0.0.5:8000"),
    ("[fd00:0:0::1]:80", "[fd00::1]:80"),
    ("[::ffff:10.0.0.1]:1", "[::ffff:a00:1]:1"),
    ("10.0.0.5", None),
    ("vllm-0.vllm:8000", None),
    ("10.0.0.5:0", None),
    ("10.0.0.5:65536", None),
    ("10.0.0.5:http", None),
    ("fd00::1:80", None),  # IPv6 without brackets is ambiguous
    ("[10.0.0.5]:80", None),
    ("10.0.0.5:８０", None),  # digits, but not ASCII ones
])
def test_an_endpoint_is_an_ip_literal_and_a_port(text: str, normalized: str | None) -> None:
    assert parse_endpoint(text) == normalized
    if normalized is not None:
        assert parse_endpoint(normalized) == normalized


def test_format_endpoint_brackets_ipv6_only() -> None:
    assert format_endpoint("127.0.0.1", 9) == "127.0.0.1:9"
    assert format_endpoint("::1", 9) == "[::1]:9"


def instance(url: str | None = None, endpoint: str | None = None,
             events: tuple[str, ...] = ()) -> Instance:
    config = InstanceConfig(url=url, endpoint=endpoint, events=events)
    return Instance(id=url or events[0], config=config, url=config.url)


def test_the_endpoint_of_an_instance() -> None:
    instances = [
        instance("http://10.0.0.5:8000"),
        instance("https://10.0.0.6"),  # the scheme's port
        instance("http://[fd00::7]:8000"),
        instance("http://localhost:8001"),  # a name: resolved
        instance("http://kvroute-test-no-such-host.invalid:8000"),  # unresolvable: none
        instance("http://vllm-0.vllm:8000", endpoint="10.1.2.3:8000"),  # as configured
        instance(events=("tcp://10.0.0.9:5557",)),  # no URL and no endpoint: none
        instance(endpoint="10.0.0.9:8000", events=("tcp://10.0.0.9:5557",)),
    ]

    async def run() -> None:
        endpoints = EndpointMap()
        try:
            found = await endpoints.endpoints(instances)
            again = await endpoints.endpoints(instances)  # from the cache now
        finally:
            await endpoints.close()
        assert found == again
        local = found.pop("http://localhost:8001")
        assert ipaddress.ip_address(parse_endpoint(local).rpartition(":")[0].strip("[]")) \
            .is_loopback and local.endswith(":8001")
        assert found == {
            "http://10.0.0.5:8000": "10.0.0.5:8000",
            "https://10.0.0.6": "10.0.0.6:443",
            "http://[fd00::7]:8000": "[fd00::7]:8000",
            "http://vllm-0.vllm:8000": "10.1.2.3:8000",
            "tcp://10.0.0.9:5557": "10.0.0.9:8000",
        }

    run_async(run)


@pytest.mark.parametrize("bad", ["vllm-0:8000", "10.0.0.5", "10.0.0.5:99999"])
def test_a_configured_endpoint_must_be_ip_port(bad: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_instance({"url": "http://vllm-0.vllm:8000", "endpoint": bad}, "request")
    assert refused.value.field == "endpoint"
    assert parse_instance({"url": "http://a:1", "endpoint": "[fd00::0:1]:8000"},
                          "request").endpoint == "[fd00::1]:8000"


# --- one guess withdrawn, one ticket moved ------------------------------------------------------


def test_withdrawing_a_guess_takes_back_only_its_own_keys() -> None:
    placements = Placements()
    first, second = [b"a", b"b", b"c"], [b"c", b"d"]
    placements.place("w", first, expires=10.0)
    placements.place("w", second, expires=20.0)  # c is guessed already: keeps 10.0
    placements.place("v", first, expires=10.0)  # another worker, same expiry
    assert placements.withdraw("w", first, expires=99.0) == 0  # not that guess
    assert placements.withdraw("w", second, expires=20.0) == 1  # d only: c is the first's
    assert placements.extent("w", [b"a", b"b", b"c", b"d"], lambda k: False) == (3, 3)
    assert placements.withdraw("w", first, expires=10.0) == 3
    assert not placements.has("w") and placements.has("v")
    placements.expire(30.0)  # the withdrawn guesses' expiries pass without a trace
    assert len(placements) == 0


def test_the_index_withdraws_the_guess_it_placed_for_a_prompt() -> None:
    index = PrefixIndex()
    tokens = list(range(1, 66))  # four full blocks of 16
    assert index.place(("a", 0), tokens, block_size=16, expires=5.0) == 4
    assert index.place(("a", 0), list(range(100, 140)), block_size=16, expires=6.0) == 2
    assert index.withdraw(("a", 0), tokens, expires=5.0) == 4
    assert index.match(tokens[:-1], now=0.0)[("a", 0)].blocks == 0
    assert index.match(list(range(100, 140)), now=0.0)[("a", 0)].pending == 2
    assert index.withdraw(("nobody", 0), tokens, expires=5.0) == 0
    assert chain_keys(tokens, 16)  # the keys it withdrew are the ones place() guessed


def test_a_ticket_moves_with_its_state() -> None:
    ledger = InFlight()
    ticket = ledger.open(("a", 0), 100)
    moved = ticket.move_to(("b", 1))
    assert not ticket.is_open and moved.is_open
    assert ledger.get(("a", 0)).requests == 0
    assert (ledger.get(("b", 1)).requests, ledger.get(("b", 1)).queued_prefill_tokens) == (1, 100)
    moved.started()
    again = moved.move_to(("c", 0))
    assert ledger.get(("c", 0)).queued_prefill_tokens == 0  # started stays started
    assert ledger.get(("c", 0)).requests == 1
    assert again.move_to(("c", 0)) is again  # to where it is: unchanged
    again.close()
    assert again.move_to(("d", 0)) is again and len(ledger) == 0  # closed: goes nowhere


# --- TLS ----------------------------------------------------------------------------------------


def test_the_self_signed_certificate_names_loopback_and_the_bound_address() -> None:
    certificate_pem, key_pem = self_signed("10.0.0.8")
    certificate = x509.load_pem_x509_certificate(certificate_pem)
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    assert {str(a) for a in names.get_values_for_type(x509.IPAddress)} == \
        {"127.0.0.1", "::1", "10.0.0.8"}
    assert certificate.issuer == certificate.subject
    assert b"PRIVATE KEY" in key_pem
    assert x509.DNSName("epp.example") in x509.load_pem_x509_certificate(
        self_signed("epp.example")[0]).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value
    identity = load_identity("0.0.0.0", None, None, None)
    assert identity.self_signed and identity.client_ca is None
    assert len(identity.fingerprint.split(":")) == 32


def test_pem_files_are_checked(tmp_path: Path) -> None:
    ca = trustme.CA()
    served, other = ca.issue_cert("localhost"), ca.issue_cert("other")
    cert, key, wrong_key = tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "w.pem"
    served.cert_chain_pems[0].write_to_path(str(cert))
    served.private_key_pem.write_to_path(str(key))
    other.private_key_pem.write_to_path(str(wrong_key))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    check_pem_files(str(cert), str(key), str(cert))
    for certfile, keyfile, ca_file, needle in [
        (str(tmp_path / "missing.pem"), str(key), None, "epp_tls_certfile: the certificate"),
        (str(cert), str(wrong_key), None, "is not the key of the first certificate"),
        (str(garbage), str(key), None, "epp_tls_certfile: "),
        (str(cert), str(garbage), None, "epp_tls_keyfile: "),
        (None, None, str(garbage), "epp_client_ca: "),
    ]:
        with pytest.raises(ValueError, match=needle):
            check_pem_files(certfile, keyfile, ca_file)


# --- settings -----------------------------------------------------------------------------------


def test_the_epp_is_off_by_default_and_on_from_each_layer(tmp_path: Path) -> None:
    assert load_settings(environ={}).epp_port is None
    config = tmp_path / "kvroute.toml"
    config.write_text("epp_port = 9002\n")
    assert load_settings(config, environ={}).epp_port == 9002
    assert load_settings(environ={"KVROUTE_EPP_PORT": "9012"}).epp_port == 9012
    args = _parser().parse_args(["serve", "--epp-port", "9022"])
    assert args.epp_port == 9022
    assert load_settings(environ={"KVROUTE_EPP_PORT": "9012"},
                         flags={"epp_port": args.epp_port}).epp_port == 9022
    settings = load_settings(environ={"KVROUTE_EPP_PORT": "9002", "KVROUTE_EPP_TLS": "off"})
    assert settings.epp_tls is False


@pytest.mark.parametrize(("environ", "field", "needle"), [
    ({"KVROUTE_EPP_PORT": "8000"}, "epp_port", "also the HTTP port"),
    ({"KVROUTE_EPP_PORT": "70000"}, "epp_port", "<= 65535"),
    ({"KVROUTE_EPP_PORT": "9002", "KVROUTE_EPP_TLS_CERTFILE": "/x.pem"}, "epp_tls_certfile",
     "both"),
    ({"KVROUTE_EPP_PORT": "9002", "KVROUTE_EPP_TLS": "false",
      "KVROUTE_EPP_CLIENT_CA": "/ca.pem"}, "epp_tls", "need it on"),
    ({"KVROUTE_EPP_PORT": "9002", "KVROUTE_EPP_CLIENT_CA": "/no/such/ca.pem"},
     "epp_client_ca", "cannot be read"),
    ({"KVROUTE_EPP_PORT": "9002", "KVROUTE_HOST": "0.0.0.0", "KVROUTE_API_TOKEN": "t"},
     "epp_port", "epp_allow_unauthenticated"),
])
def test_bad_epp_settings_are_named(environ: dict[str, str], field: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as refused:
        load_settings(environ=environ)
    assert refused.value.field == field


def test_an_exposed_epp_needs_client_certificates_or_an_explicit_waiver(tmp_path: Path) -> None:
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    exposed = {"KVROUTE_EPP_PORT": "9002", "KVROUTE_HOST": "0.0.0.0", "KVROUTE_API_TOKEN": "t"}
    assert load_settings(environ=exposed | {"KVROUTE_EPP_CLIENT_CA": str(ca_file)}).epp_client_ca
    waived = load_settings(environ=exposed | {"KVROUTE_EPP_ALLOW_UNAUTHENTICATED": "true"})
    assert waived.epp_allow_unauthenticated and waived.epp_port == 9002
    # On loopback only this machine reaches it.
    assert load_settings(environ={"KVROUTE_EPP_PORT": "9002"}).epp_port == 9002


def test_an_epp_port_already_taken_is_one_clear_line() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "kvroute.app.cli", "serve", "--port", "0", "--epp-port",
             str(port)], capture_output=True, text=True, timeout=scaled(60))
    assert result.returncode == 1
    assert f"the Endpoint Picker cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr

