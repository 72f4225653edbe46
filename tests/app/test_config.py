"""Configuration layering and validation: every bad value is a ConfigError naming it."""

from __future__ import annotations

import re

import msgspec
import pytest

from kvroute.app.config import (
    ConfigError,
    InstanceConfig,
    Settings,
    default_instance_id,
    load_settings,
    parse_instance,
)
from tests.support.paths import REPO


def write(tmp_path, text: str):
    path = tmp_path / "kvroute.toml"
    path.write_text(text)
    return path


def test_defaults_bind_loopback():
    settings = load_settings(environ={})
    assert settings.host == "127.0.0.1"
    assert settings.port == 8000
    assert settings.instances == ()
    assert settings.tokenizer is None


def test_port_zero_asks_the_os_for_a_free_port():
    assert load_settings(environ={"KVROUTE_PORT": "0"}).port == 0


def test_file_env_and_flags_layer_in_order(tmp_path):
    path = write(tmp_path, 'port = 9000\nhost = "0.0.0.0"\n[[instances]]\nurl = "http://a:8000"\n')
    env = {"KVROUTE_PORT": "9100", "KVROUTE_INSTANCES": "http://b:8000, http://c:8001",
           "KVROUTE_API_TOKEN": "t"}
    settings = load_settings(path, environ=env, flags={"port": 9200, "host": None})
    assert settings.port == 9200  # flag beats env beats file
    assert settings.host == "0.0.0.0"  # a flag left unset does not override
    assert [i.url for i in settings.instances] == ["http://a:8000", "http://b:8000",
                                                   "http://c:8001"]


def test_explicit_endpoints_per_rank(tmp_path):
    path = write(tmp_path, """
[[instances]]
id = "gpu-a"
model = "m"
events = ["tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"]
replay = ["tcp://10.0.0.1:6557", "tcp://10.0.0.1:6558"]
""")
    (instance,) = load_settings(path, environ={}).instances
    assert instance == InstanceConfig(id="gpu-a", model="m",
                                      events=("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"),
                                      replay=("tcp://10.0.0.1:6557", "tcp://10.0.0.1:6558"))
    assert default_instance_id(instance) == "gpu-a"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("port = 'x'", "port: expected `int`, got 'x'"),
        ("port = 70000", "port: expected `int` <= 65535, got 70000"),
        ("port = -1", "port: expected `int` >= 0"),
        ("ready_grace_seconds = -1", "ready_grace_seconds"),
        ("log_level = 'loud'", "log_level: invalid enum value 'loud'; one of critical"),
        ("colour = 'blue'", "colour: unknown setting; known: host, port"),
        ("port = ", "not valid TOML"),
        ("[[instances]]\nurl = 'ftp://x'", "instances[0].url"),
        ("[[instances]]\nmodel = 'm'", "give `url`"),
        ("[[instances]]\nevents = ['tcp://*:5557']", "bind address"),
        ("[[instances]]\nevents = ['udp://h:1']", "not a tcp://HOST:PORT"),
        ("[[instances]]\nurl = 'http://h:1'\nbogus = 1",
         "instances[0].bogus: unknown setting; known: url, id"),
        ("[[instances]]\nevents = ['tcp://h:1']\nreplay = ['tcp://h:2', 'tcp://h:3']",
         "one per data-parallel rank"),
        ("[[instances]]\nevents = ['tcp://h:1', 'tcp://h:2']\nreplay = 'tcp://h:65535'",
         "replay: 'tcp://h:65535' numbers 2 ranks past port 65535"),
        ("[[instances]]\nurl = 'http://h:1'\nblock_size = 0",
         "instances[0].block_size: expected `int` >= 1, got 0"),
    ],
)
def test_bad_file_values_are_named(tmp_path, text, needle):
    with pytest.raises(ConfigError, match=None) as info:
        load_settings(write(tmp_path, text), environ={})
    assert needle in str(info.value)
    assert "config file" in str(info.value)


def test_one_replay_endpoint_numbers_the_ranks_as_vllm_does(tmp_path):
    """Rank r of a data-parallel engine replays on the first rank's port + r."""
    settings = load_settings(write(tmp_path, "[[instances]]\nevents = ['tcp://h:5557', "
                                             "'tcp://h:5558', 'tcp://[fd00::1]:6000']\n"
                                             "replay = 'tcp://h:5560'"), environ={})
    assert settings.instances[0].replay == ("tcp://h:5560", "tcp://h:5561", "tcp://h:5562")
    one = load_settings(write(tmp_path, "[[instances]]\nevents = 'tcp://h:5557'\n"
                                        "replay = 'tcp://h:5560'"), environ={})
    assert one.instances[0].replay == ("tcp://h:5560",)


def test_bad_environment_is_named():
    with pytest.raises(ConfigError) as info:
        load_settings(environ={"KVROUTE_MAX_PROMPT_TOKENS": "many"})
    assert "environment" in str(info.value) and "max_prompt_tokens" in str(info.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml", environ={})


def test_default_instance_id_from_url():
    assert default_instance_id(InstanceConfig(url="http://h:8001")) == "h:8001"
    assert default_instance_id(InstanceConfig(url="https://h")) == "h:443"
    assert default_instance_id(InstanceConfig(events=("tcp://h:5557",))) == "h:5557"


def test_an_instance_configured_twice_is_refused(tmp_path):
    path = write(tmp_path, '[[instances]]\nurl = "http://a:8000"\n')
    with pytest.raises(ConfigError, match="a:8000 configured more than once"):
        load_settings(path, environ={"KVROUTE_INSTANCES": "http://a:8000/"})


def test_an_instance_api_key_is_read_but_never_shown(tmp_path):
    path = write(tmp_path, '[[instances]]\nurl = "http://a:8000"\napi_key = "s3cret"\n')
    settings = load_settings(path, environ={})
    assert settings.instances[0].api_key == "s3cret"
    assert "s3cret" not in repr(settings)


@pytest.mark.parametrize(
    ("environ", "field", "needle"),
    [
        ({"KVROUTE_LOAD_INTERVAL": "inf"}, "load_interval", "finite"),
        ({"KVROUTE_PORT": "-3"}, "port", ">= 0, got '-3'"),
        ({"KVROUTE_PROXY": "maybe"}, "proxy", "expected `bool`, got 'maybe'"),
        ({"KVROUTE_INSTANCES": "http://a:1,ftp://b"}, "instances[1].url", "is not an http(s)"),
    ],
)
def test_environment_errors_name_the_field(environ, field, needle):
    with pytest.raises(ConfigError) as info:
        load_settings(environ=environ)
    assert info.value.field == field
    assert str(info.value).startswith(f"environment: {field}: ") and needle in str(info.value)


def test_environment_words_for_booleans_and_levels():
    settings = load_settings(environ={"KVROUTE_PROXY": "on", "KVROUTE_LOG_LEVEL": "DEBUG",
                                      "KVROUTE_PLACEMENT_TTL": "0.5"})
    assert settings.proxy is True and settings.log_level == "debug"
    assert settings.placement_ttl == 0.5


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "kvroute.example"])
def test_an_exposed_address_needs_a_token_or_an_explicit_waiver(host):
    with pytest.raises(ConfigError, match="--allow-unauthenticated") as info:
        load_settings(environ={"KVROUTE_HOST": host})
    assert info.value.field == "host"
    for extra in ({"KVROUTE_API_TOKEN": "t"}, {"KVROUTE_ADMIN_TOKEN": "t"},
                  {"KVROUTE_ALLOW_UNAUTHENTICATED": "true"}):
        assert load_settings(environ={"KVROUTE_HOST": host, **extra}).host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_token(host):
    assert load_settings(environ={"KVROUTE_HOST": host}).host == host


def test_tokens_are_read_but_never_shown():
    settings = load_settings(environ={"KVROUTE_API_TOKEN": "route-secret",
                                      "KVROUTE_ADMIN_TOKEN": "admin-secret"})
    assert (settings.api_token, settings.admin_token) == ("route-secret", "admin-secret")
    assert "secret" not in repr(settings)


@pytest.mark.parametrize("name", ["API_TOKEN", "ADMIN_TOKEN"])
@pytest.mark.parametrize("token", ["jeton-d\u00e9j\u00e0", " padded", "tab\tinside"])
def test_a_token_no_header_can_carry_is_refused_at_start(name, token):
    with pytest.raises(ConfigError, match="printable ASCII") as info:
        load_settings(environ={f"KVROUTE_{name}": token})
    assert info.value.field == name.lower()
    assert token.strip() not in str(info.value)  # never shown, even when refused


def test_blank_names_are_refused():
    with pytest.raises(ConfigError, match="instances\\[0\\].id: must be .* not begin or end"):
        load_settings(environ={}, flags={"instances": [{"url": "http://a:1", "id": "  "}]})


def test_configured_endpoints_must_be_on_the_instance_host_unless_allowed(tmp_path):
    text = """
[[instances]]
url = "http://10.0.0.5:8000"
events = ["tcp://10.0.0.6:5557"]
"""
    with pytest.raises(ConfigError) as refused:
        load_settings(write(tmp_path, text), environ={})
    assert "tcp://10.0.0.6:5557" in str(refused.value) and "zmq_endpoint_hosts" in str(
        refused.value)
    assert refused.value.field == "instances[0].events"
    allowed = load_settings(write(tmp_path, 'zmq_endpoint_hosts = ["10.0.0.6"]\n' + text),
                            environ={})
    assert allowed.instances[0].events == ("tcp://10.0.0.6:5557",)


def test_more_configured_instances_than_max_instances_is_refused():
    with pytest.raises(ConfigError, match=r"3 instances configured, more than max_instances"):
        load_settings(environ={"KVROUTE_MAX_INSTANCES": "2",
                               "KVROUTE_INSTANCES": "http://a:1,http://b:1,http://c:1"})


def test_tls_needs_both_files_and_they_may_come_from_different_layers(tmp_path):
    with pytest.raises(ConfigError, match="both tls_certfile and tls_keyfile"):
        load_settings(environ={"KVROUTE_TLS_CERTFILE": "cert.pem"})
    both = load_settings(write(tmp_path, 'tls_certfile = "cert.pem"\n'),
                         environ={"KVROUTE_TLS_KEYFILE": "key.pem"})
    assert (both.tls_certfile, both.tls_keyfile) == ("cert.pem", "key.pem")


def test_list_settings_from_the_environment_are_comma_separated():
    settings = load_settings(environ={"KVROUTE_ALLOWED_HOSTS": "kvroute.example, *.svc ,",
                                      "KVROUTE_ZMQ_ENDPOINT_HOSTS": "10.0.0.6"})
    assert settings.allowed_hosts == ("kvroute.example", "*.svc")
    assert settings.zmq_endpoint_hosts == ("10.0.0.6",)


def test_timeouts_must_be_positive():
    with pytest.raises(ConfigError, match=r"environment: header_timeout: expected `float` > 0"):
        load_settings(environ={"KVROUTE_HEADER_TIMEOUT": "0"})


def test_every_setting_is_in_the_configuration_pages_table():
    readme = (REPO / "docs" / "configuration.md").read_text()
    table = readme.split("| setting | default | environment | flag |")[1].split("\n\n")[0]
    documented = set(re.findall(r"^\| `(\w+)`(?:, `(\w+)`)?", table, re.M))
    names = {name for pair in documented for name in pair if name}
    assert names == {f.name for f in msgspec.structs.fields(Settings)}


@pytest.mark.parametrize("bad", ["a/b", "gpu\x16a", "tab\there", "line\nbreak", "x\x9c",
                                 "gpü", " a", "a "])
def test_an_instance_id_must_be_printable_ascii_and_have_no_slash(bad):
    """It names the instance in URLs (DELETE /v1/instances/{id}), logs, metric labels and the
    proxy's x-kvroute-instance header (whose value must be ASCII: an id outside it made the
    proxy's answer fail with a 500)."""
    with pytest.raises(ConfigError) as refused:
        parse_instance({"url": "http://10.0.0.5:8000", "id": bad}, "request")
    assert refused.value.field == "id"
    assert parse_instance({"url": "http://10.0.0.5:8000", "id": "gpu-a 1"}, "request").id


@pytest.mark.parametrize("bad", ["ké", " k", "k\n", ""])
def test_an_api_key_must_fit_in_a_header(bad):
    """It is sent as `Authorization: Bearer <key>`: a non-ASCII key made registration answer
    500 (httpx could not encode the header; found by schemathesis)."""
    with pytest.raises(ConfigError) as refused:
        parse_instance({"url": "http://10.0.0.5:8000", "api_key": bad}, "request")
    assert refused.value.field == "api_key"
    assert parse_instance({"url": "http://10.0.0.5:8000", "api_key": "sk-1 x"}, "request")
