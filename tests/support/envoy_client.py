"""An ext_proc client that talks to an Endpoint Picker the way Envoy does, for the EPP
tests and the end-to-end check (no Envoy binary can be installed here).

Envoy's side of the Gateway API Inference Extension's picker protocol: the request
headers (without `end_of_stream` when a body follows), the body in chunks, the last one
with `end_of_stream` (or trailers after the last chunk), all sent without waiting for any
answer (FULL_DUPLEX_STREAMED); then, once the picker has answered, the response's headers,
body chunks and trailers, with the endpoint that served in `metadata_context`. This module
only builds and carries the messages; whoever uses it judges the answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import struct_pb2

__all__ = ["EnvoyStream", "Pick", "channel", "metadata", "pick"]

FULL_DUPLEX = ext_proc.ProtocolConfiguration(
    request_body_mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED,
    response_body_mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED)
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"


def channel(port: int, certificate: bytes | None, *, host: str = "127.0.0.1",
            client_key: bytes | None = None, client_chain: bytes | None = None
            ) -> grpc.aio.Channel:
    """A channel to the picker; with `certificate`, TLS trusting exactly that certificate
    (a self-signed picker's own), the name checked being `localhost`."""
    target = f"{host}:{port}"
    if certificate is None:
        return grpc.aio.insecure_channel(target)
    credentials = grpc.ssl_channel_credentials(root_certificates=certificate,
                                               private_key=client_key,
                                               certificate_chain=client_chain)
    return grpc.aio.secure_channel(target, credentials,
                                   options=[("grpc.ssl_target_name_override", "localhost")])


def metadata(values: Mapping[str, Mapping[str, Any]]) -> base_pb2.Metadata:
    """`filter_metadata` namespaces as Envoy forwards them in `metadata_context`."""
    found = base_pb2.Metadata()
    for namespace, fields in values.items():
        struct = struct_pb2.Struct()
        struct.update(dict(fields))
        found.filter_metadata[namespace].CopyFrom(struct)
    return found


def _header_map(headers: Iterable[tuple[str, str]]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=name.lower(), raw_value=value.encode())
        for name, value in headers])


class EnvoyStream:
    """One `Process` call, driven message by message. As in Envoy, what the picker sends is
    received as it arrives (a reader task keeps it in order), whatever is being sent."""

    def __init__(self, stub: ext_proc_grpc.ExternalProcessorStub, timeout: float) -> None:
        self.call = stub.Process()
        self.timeout = timeout
        self._first = True
        self._inbox: asyncio.Queue[ext_proc.ProcessingResponse | Exception | None] = \
            asyncio.Queue()
        self._reader = asyncio.ensure_future(self._receive())

    async def _receive(self) -> None:
        """Every response into the inbox, then None (the end) or the call's error. Ends
        with the call."""
        try:
            while True:
                message = await self.call.read()
                if message is grpc.aio.EOF:
                    break
                self._inbox.put_nowait(message)
        except grpc.aio.AioRpcError as exc:
            self._inbox.put_nowait(exc)
        except asyncio.CancelledError:  # the call was cancelled (or this reader was)
            pass
        self._inbox.put_nowait(None)

    async def send(self, request: ext_proc.ProcessingRequest) -> None:
        """Send one message. Like Envoy, it does not wait for answers in between; a picker
        that has ended the stream (an immediate response) makes the rest go nowhere, and
        what it said is still there to read."""
        if self._first:  # Envoy sends its processing modes with the first message only
            request.protocol_config.CopyFrom(FULL_DUPLEX)
            self._first = False
        try:
            await asyncio.wait_for(self.call.write(request), self.timeout)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            if not self.call.done():
                raise

    async def request_headers(self, method: str, path: str, *, end_of_stream: bool,
                              headers: Iterable[tuple[str, str]] = (),
                              context: base_pb2.Metadata | None = None) -> None:
        pseudo = [(":method", method), (":path", path), (":authority", "gateway.test"),
                  (":scheme", "http")]
        await self.send(ext_proc.ProcessingRequest(
            request_headers=ext_proc.HttpHeaders(headers=_header_map([*pseudo, *headers]),
                                                 end_of_stream=end_of_stream),
            metadata_context=context))

    async def request_body(self, chunk: bytes, *, end_of_stream: bool) -> None:
        await self.send(ext_proc.ProcessingRequest(
            request_body=ext_proc.HttpBody(body=chunk, end_of_stream=end_of_stream)))

    async def request_trailers(self, trailers: Iterable[tuple[str, str]]) -> None:
        await self.send(ext_proc.ProcessingRequest(
            request_trailers=ext_proc.HttpTrailers(trailers=_header_map(trailers))))

    async def response_headers(self, status: int, *, served: str | None = None,
                               headers: Iterable[tuple[str, str]] = (),
                               end_of_stream: bool = False) -> None:
        await self.send(ext_proc.ProcessingRequest(
            response_headers=ext_proc.HttpHeaders(
                headers=_header_map([(":status", str(status)), *headers]),
                end_of_stream=end_of_stream),
            metadata_context=_served(served)))

    async def response_body(self, chunk: bytes, *, end_of_stream: bool,
                            served: str | None = None) -> None:
        await self.send(ext_proc.ProcessingRequest(
            response_body=ext_proc.HttpBody(body=chunk, end_of_stream=end_of_stream),
            metadata_context=_served(served)))

    async def response_trailers(self, trailers: Iterable[tuple[str, str]]) -> None:
        await self.send(ext_proc.ProcessingRequest(
            response_trailers=ext_proc.HttpTrailers(trailers=_header_map(trailers))))

    async def read(self) -> ext_proc.ProcessingResponse | None:
        """The next response; None when the picker ended the stream (and from then on)."""
        item = await asyncio.wait_for(self._inbox.get(), self.timeout)
        if item is None:
            self._inbox.put_nowait(None)
        if isinstance(item, Exception):
            raise item
        return item

    async def finish(self) -> grpc.StatusCode:
        """Half-close (the HTTP request is over) and wait for the picker's status."""
        await asyncio.wait_for(self.call.done_writing(), self.timeout)
        return await asyncio.wait_for(self.call.code(), self.timeout)

    def cancel(self) -> None:
        """What Envoy does when the downstream client goes away: reset the stream."""
        self.call.cancel()
        self._reader.cancel()


def _served(endpoint: str | None) -> base_pb2.Metadata | None:
    return None if endpoint is None else metadata({LB_NAMESPACE: {SERVED_KEY: endpoint}})


@dataclass
class Pick:
    """A picker's answer to a whole request: the headers it set, its dynamic metadata, and
    the body it sent on (or the immediate response it gave instead)."""

    headers: dict[str, str] = field(default_factory=dict)
    dynamic_metadata: dict[str, Any] = field(default_factory=dict)
    body: bytes = b""
    immediate: ext_proc.ImmediateResponse | None = None

    @property
    def endpoint(self) -> str | None:
        return self.headers.get("x-gateway-destination-endpoint")


async def pick(stream: EnvoyStream, path: str, body: bytes, *, chunk_size: int = 16_384,
               headers: Iterable[tuple[str, str]] = (("content-type", "application/json"),),
               context: base_pb2.Metadata | None = None) -> Pick:
    """Send one POST the way Envoy does and collect the picker's answer to it."""
    await stream.request_headers("POST", path, end_of_stream=False, context=context,
                                 headers=[*headers, ("content-length", str(len(body)))])
    chunks = [body[i:i + chunk_size] for i in range(0, len(body), chunk_size)] or [b""]
    for number, chunk in enumerate(chunks):
        await stream.request_body(chunk, end_of_stream=number == len(chunks) - 1)
    found = Pick()
    while True:
        message = await stream.read()
        if message is None:
            raise ConnectionError("the picker ended the stream before answering")
        kind = message.WhichOneof("response")
        if kind == "immediate_response":
            found.immediate = message.immediate_response
            return found
        if kind == "request_headers":
            mutation = message.request_headers.response.header_mutation
            found.headers = {h.header.key: (h.header.raw_value or h.header.value.encode()
                                            ).decode() for h in mutation.set_headers}
            found.dynamic_metadata = _plain_struct(message.dynamic_metadata)
        elif kind == "request_body":
            streamed = message.request_body.response.body_mutation.streamed_response
            found.body += streamed.body
            if streamed.end_of_stream:
                return found
        else:
            raise ConnectionError(f"unexpected {kind} before the request was answered")


def _plain_struct(struct: struct_pb2.Struct) -> dict[str, Any]:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(struct)
