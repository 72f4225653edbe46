"""The Endpoint Picker protocol's messages: what kvroute reads from Envoy's ext_proc
requests and the responses it builds. Pure functions over the generated Envoy types
(PyPI `xds-protos`); no I/O.

What a picker answers (the Gateway API Inference Extension's endpoint picker protocol):

- to the request: one `HeadersResponse` whose `CommonResponse` sets
  `x-gateway-destination-endpoint: IP:PORT` (and `x-data-parallel-rank`, and
  `content-length` when the body is sent on) with `clear_route_cache`, the same endpoint in
  `dynamic_metadata` under `envoy.lb`, then the body as `StreamedBodyResponse` chunks of at
  most MAX_CHUNK_BYTES, `end_of_stream` on the last one when the request ended with its
  body; a request that ended with trailers gets its body chunks without `end_of_stream` and
  then a `TrailersResponse` (Envoy's FULL_DUPLEX_STREAMED contract: the trailers tell the
  end of the body, and responses keep the headers-body-trailers order);
- or an `ImmediateResponse` with a status and kvroute's JSON error body;
- to the response: an empty `HeadersResponse`, the body echoed chunk by chunk, an empty
  `TrailersResponse`.

Every header kvroute sets replaces what the client sent under that name
(OVERWRITE_IF_EXISTS_OR_ADD): a client must not choose the endpoint or the engine itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

__all__ = [
    "DESTINATION", "DP_RANK_HEADER", "EXT_PROC_SERVICE", "LB_NAMESPACE", "MAX_CHUNK_BYTES",
    "SERVED", "SUBSET_KEY", "SUBSET_NAMESPACE", "headers_of", "immediate", "metadata_value",
    "request_body", "request_trailers", "response_body", "response_headers",
    "response_trailers", "routed",
]

EXT_PROC_SERVICE = ext_proc.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
DP_RANK_HEADER = "x-data-parallel-rank"
# Some gateways cap a streamed chunk at 64 KiB; the reference pickers keep a margin.
MAX_CHUNK_BYTES = 62_000

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def headers_of(header_map: base_pb2.HeaderMap) -> dict[str, str]:
    """Header name (lowercase) -> value. Envoy sends values in `raw_value` (older ones in
    `value`); a name sent more than once has its values joined with ", "."""
    found: dict[str, str] = {}
    for header in header_map.headers:
        value = (header.raw_value.decode("utf-8", "replace") if header.raw_value
                 else header.value)
        name = header.key.lower()
        found[name] = f"{found[name]}, {value}" if name in found else value
    return found


def metadata_value(request: ext_proc.ProcessingRequest, namespace: str, key: str) -> Any:
    """`metadata_context.filter_metadata[namespace][key]` as plain Python (str, float,
    bool, list, dict, None); None also when it is absent."""
    filters = request.metadata_context.filter_metadata
    if namespace not in filters or key not in filters[namespace].fields:
        return None
    return _plain(filters[namespace].fields[key])


def _plain(value: struct_pb2.Value) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [_plain(item) for item in value.list_value.values]
    if kind == "struct_value":
        return {name: _plain(item) for name, item in value.struct_value.fields.items()}
    if kind in ("string_value", "number_value", "bool_value"):
        return getattr(value, kind)
    return None


def _set(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode("utf-8")),
        append_action=_OVERWRITE)


def routed(endpoint: str, dp_rank: int, body_length: int | None) -> ext_proc.ProcessingResponse:
    """The answer to the request headers once a worker is chosen. `body_length`: the bytes
    sent on as the body, which Content-Length then declares (None: the request has none)."""
    headers = [_set(DESTINATION, endpoint), _set(DP_RANK_HEADER, str(dp_rank))]
    if body_length is not None:
        headers.append(_set("content-length", str(body_length)))
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: endpoint}})
    return ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(response=ext_proc.CommonResponse(
            header_mutation=ext_proc.HeaderMutation(set_headers=headers),
            clear_route_cache=True)),
        dynamic_metadata=metadata)


def _chunks(body: bytes) -> Iterator[tuple[bytes, bool]]:
    """(chunk, is the last one); an empty body is one empty chunk."""
    if not body:
        yield b"", True
        return
    for start in range(0, len(body), MAX_CHUNK_BYTES):
        yield body[start:start + MAX_CHUNK_BYTES], start + MAX_CHUNK_BYTES >= len(body)


def _streamed(chunk: bytes, end_of_stream: bool) -> ext_proc.BodyResponse:
    return ext_proc.BodyResponse(response=ext_proc.CommonResponse(
        body_mutation=ext_proc.BodyMutation(streamed_response=ext_proc.StreamedBodyResponse(
            body=chunk, end_of_stream=end_of_stream))))


def request_body(body: bytes, *, end_of_stream: bool) -> list[ext_proc.ProcessingResponse]:
    """The request body sent on unchanged; `end_of_stream` on the last chunk only when the
    request ends with it (no trailers follow)."""
    return [ext_proc.ProcessingResponse(request_body=_streamed(chunk, end_of_stream and last))
            for chunk, last in _chunks(body)]


def request_trailers() -> ext_proc.ProcessingResponse:
    return ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())


def response_headers() -> ext_proc.ProcessingResponse:
    return ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())


def response_body(body: bytes, *, end_of_stream: bool,
                  streamed: bool) -> list[ext_proc.ProcessingResponse]:
    """One response body chunk, unchanged: echoed as streamed chunks in FULL_DUPLEX_STREAMED
    mode, or acknowledged without a mutation in the other body modes."""
    if not streamed:
        return [ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse())]
    return [ext_proc.ProcessingResponse(response_body=_streamed(chunk, end_of_stream and last))
            for chunk, last in _chunks(body)]


def response_trailers() -> ext_proc.ProcessingResponse:
    return ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())


def immediate(status: int, payload: dict[str, Any], details: str) -> ext_proc.ProcessingResponse:
    """A local reply with `status` and `payload` as its JSON body; `details` names the
    reason in the gateway's access log (%RESPONSE_CODE_DETAILS%)."""
    return ext_proc.ProcessingResponse(immediate_response=ext_proc.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),  # type: ignore[arg-type]
        headers=ext_proc.HeaderMutation(set_headers=[_set("content-type", "application/json")]),
        body=msgspec.json.encode(payload),
        details=details))
