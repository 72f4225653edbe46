"""schemathesis hooks for tests/api/test_openapi_fuzz.py (loaded through SCHEMATHESIS_HOOKS).

Registrations the fuzzer draws name random hosts; tests must not reach the network, and an
instance that cannot be discovered is a 502 by design. So, in `POST /v1/instances` cases:

- a `url` the schema admits becomes the simulated vLLM instance's own (KVROUTE_FUZZ_URL), and
  every `events` / `replay` endpoint the schema admits becomes the instance's
  (KVROUTE_FUZZ_EVENTS / KVROUTE_FUZZ_REPLAY). A value is only ever replaced by another value
  the schema admits, so a case stays exactly as valid or invalid as it was drawn;
- a case whose `replay` is a list of another length than `events`, or whose endpoint names
  a bind address, is left out: both are refusals app.api.contract documents (422) that JSON
  Schema cannot express (one `replay` endpoint for several ranks is numbered as vLLM numbers
  them, and accepted). Nothing else is left out;
- a registration without an `id` gets a fresh one (the id would be the url's HOST:PORT, the
  simulated instance's in every case, so all but the first would only meet "already
  registered"); a value the schema admits, in a body it admitted or refused already.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import schemathesis

from kvroute.app.config import BIND_HOSTS
from kvroute.app.patterns import HTTP_ORIGIN, ZMQ_ENDPOINT, matches

REGISTRATION = ("POST", "/v1/instances")
_FRESH = itertools.count()


def _registration(context: Any, case: Any) -> dict[str, Any] | None:
    operation = case.operation
    if (operation.method.upper(), operation.path) != REGISTRATION:
        return None
    return case.body if isinstance(case.body, dict) else None


def _endpoints(value: Any) -> list[Any]:
    return [value] if isinstance(value, str) else value if isinstance(value, list) else []


def _host(endpoint: Any) -> str:
    text = endpoint if isinstance(endpoint, str) else ""
    return text.partition("://")[2].rpartition(":")[0].strip("[]").lower()


@schemathesis.hook
def filter_case(context: Any, case: Any) -> bool:
    body = _registration(context, case)
    if body is None:
        return True
    events, replay = _endpoints(body.get("events")), _endpoints(body.get("replay"))
    if isinstance(body.get("replay"), list) and replay and len(replay) != len(events):
        return False
    return not any(_host(endpoint) in BIND_HOSTS for endpoint in events + replay)


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    """Right before each request of every phase (the schema's own examples included)."""
    body = _registration(context, case)
    if body is None:
        return
    if "id" not in body:
        # Without one, the id is the url's HOST:PORT, the simulated instance's for every
        # case after the first: a fresh id lets registration go past "already registered".
        body["id"] = f"fuzz-{next(_FRESH)}"
    url = body.get("url")
    if isinstance(url, str) and matches(HTTP_ORIGIN, url):
        body["url"] = os.environ["KVROUTE_FUZZ_URL"]
    for name, target in (("events", "KVROUTE_FUZZ_EVENTS"), ("replay", "KVROUTE_FUZZ_REPLAY")):
        value = body.get(name)
        if isinstance(value, str) and matches(ZMQ_ENDPOINT, value):
            body[name] = os.environ[target]
        elif isinstance(value, list):
            body[name] = [os.environ[target] if isinstance(item, str)
                          and matches(ZMQ_ENDPOINT, item) else item for item in value]
