"""Why a request cannot be answered as asked, in the service's own terms.

The service, the proxy and the tokenizer raise these; only the HTTP layer (`app.http.app`)
knows which status each kind is answered with, so nothing below it speaks HTTP. Every
kind carries a message for people, the request field at fault when there is one, and
optional extra detail that the JSON answer includes.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AlreadyExists", "Busy", "Conflict", "InvalidRequest", "LimitReached", "MalformedRequest",
    "NoEligibleWorker", "NotAllowed", "NotFound", "RequestError", "TimedOut", "TooLarge",
    "Unauthorized", "UnsupportedMediaType", "UpstreamFailed", "split_validation",
]


class RequestError(Exception):
    """Base of every refusal; never raised itself."""

    def __init__(self, message: str, field: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.message, self.field, self.extra = message, field, extra

    def payload(self) -> dict[str, Any]:
        """The JSON error shape every refusal is answered with, over HTTP and gRPC."""
        return {"error": self.message, "field": self.field, **self.extra}

    def at(self, field: str) -> RequestError:
        """The same refusal, blamed on `field` (a lower layer could not know it)."""
        return type(self)(self.message, field, **self.extra)


class MalformedRequest(RequestError):
    """The body is not the request the endpoint reads: not JSON, not an object, or an
    OpenAI field of the wrong type; or the prompt cannot be tokenized."""


class Unauthorized(RequestError):
    """The endpoint is guarded by a token and the request's bearer token is missing or
    another."""


class UnsupportedMediaType(RequestError):
    """A body that is not declared as JSON: refusing it keeps browsers' simple cross-site
    requests (text/plain, forms) from reaching anything that changes state."""


class NotAllowed(RequestError):
    """The operator's configuration does not allow what a well-formed request asks (event
    endpoints on another host than the instance's, unless `zmq_endpoint_hosts` lists it)."""


class InvalidRequest(RequestError):
    """A well-formed request with a value kvroute cannot accept (a token id out of
    range, two inputs at once, an unknown candidate)."""


class TooLarge(RequestError):
    """The body or the prompt is over a configured limit."""


class NotFound(RequestError):
    """The request names an instance or model kvroute does not know."""


class AlreadyExists(RequestError):
    """Registering an instance under an id already registered."""


class Conflict(RequestError):
    """A well-formed request the instances' current state cannot serve: a registration whose
    `model` the instance does not serve, a text prompt whose eligible instances have no url to
    tokenize with. The same request can succeed once that state changes."""


class LimitReached(RequestError):
    """Registering one instance more than `max_instances`."""


class TimedOut(RequestError):
    """The client did not send its whole body within `body_timeout`."""


class Busy(RequestError):
    """`max_concurrent_requests` are being served already; the client may retry."""


class NoEligibleWorker(RequestError):
    """No live worker can take the request (none registered, none serves the model, or
    every one has refused the connection)."""


class UpstreamFailed(RequestError):
    """An instance kvroute had to ask (to discover, tokenize or forward) failed."""


def split_validation(message: str) -> tuple[str, str]:
    """msgspec's `Expected `int` - at `$.token_ids[3]`` as (`Expected `int``,
    `token_ids[3]`); the path is empty for the document itself."""
    text, found, path = message.rpartition(" - at `")
    if not found:
        return message, ""
    return text, path.rstrip("`").removeprefix("$").removeprefix(".")
