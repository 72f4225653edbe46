"""The body of `POST /v1/route` (and the routing question the proxy asks for an OpenAI
request): one msgspec struct that requests are decoded with and that the OpenAPI document
describes.

Invariants:
- `route_request_type(settings)` is `RouteRequest` with the settings' size limits in its
  field types, so msgspec refuses a longer `token_ids`, `block_hashes` or `prompt` while
  decoding (a 422 naming the field) and the schema states the same maxima.
- A rule JSON Schema can state but msgspec cannot check is written once here as schema and
  checked by the service with the same constant: the block-hash pattern and integer range
  (`parse_hash`), "exactly one input" (`Service.decide`), the text of content parts.
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any

import msgspec

from kvroute.app.config import Settings
from kvroute.app.errors import InvalidRequest
from kvroute.app.patterns import BLOCK_HASH_HEX, INSTANCE_ID, described, documented, matches

__all__ = ["INPUTS", "ChatMessage", "RouteRequest", "inputs_schema", "parse_hash",
           "route_request_type"]

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
# vLLM block hashes: signed (older versions) or unsigned 64-bit ints, or hex strings. msgspec
# bounds cannot span both ranges, so `parse_hash` checks them.
HASH_MIN, HASH_END = -(2**63), 2**64
IntHash = Annotated[int, msgspec.Meta(
    extra_json_schema={"minimum": HASH_MIN, "exclusiveMaximum": HASH_END})]
EngineHash = IntHash | described(str, BLOCK_HASH_HEX)
# A content part's `text`, when it has one, is text (checked with the prompt's size).
ContentPart = Annotated[dict[str, Any], msgspec.Meta(
    extra_json_schema={"properties": {"text": {"type": "string"}}})]
# A candidate that is not a registered instance's id is a 404.
InstanceId = described(str, INSTANCE_ID)

# The prompt, given exactly one way; the last two need a tokenizer.
INPUTS = ("token_ids", "block_hashes", "prompt", "messages")
TEXT_INPUTS = frozenset({"prompt", "messages"})


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    """An OpenAI chat message; kvroute tokenizes `role` and `content` (other fields are
    ignored)."""

    role: str
    content: str | list[ContentPart] | None = None


# What each input is, for people (the limited fields of route_request_type say it too).
TOKEN_IDS = "the prompt's token ids (at most `max_prompt_tokens`)"
BLOCK_HASHES = ("vLLM's block hashes of the prompt: 64-bit ints, signed or not, or hex "
                "strings (at most `max_block_hashes`)")
PROMPT = "text, tokenized as the instance would (at most `max_prompt_chars` characters)"


class RouteRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Exactly one of `token_ids`, `block_hashes`, `prompt` (text) or `messages` (chat)."""

    token_ids: documented(list[TokenId] | None, TOKEN_IDS) = None
    block_hashes: documented(list[EngineHash] | None, BLOCK_HASHES) = None
    prompt: documented(str | None, PROMPT) = None
    messages: documented(Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] | None,
                         "a chat, rendered with the model's chat template") = None
    model: documented(str | None, "only instances serving it (a LoRA adapter's name "
                                  "matches the blocks cached for it)") = None
    lora_name: documented(str | None, "the LoRA adapter the blocks were cached under") = None
    candidates: documented(
        Annotated[list[InstanceId], msgspec.Meta(min_length=1)] | None,
        "only these instances (ids)") = None
    # The caller only asks what kvroute would do and will not send the request: the answer
    # leaves no placement guess and does not count as load on the chosen worker.
    probe: documented(bool, "only asking: the answer leaves no placement guess and counts "
                            "as no load") = False
    # An answer shows the chosen worker and the few cheapest others; every eligible
    # worker's score costs the fleet's size in time and bytes, so only when asked.
    all_scores: documented(bool, "answer every eligible worker's score, not only the chosen "
                                 "worker's and the cheapest others' (for debugging)") = False


def route_request_type(settings: Settings) -> type[RouteRequest]:
    """RouteRequest with `settings`' limits on the prompt's length."""
    return _limited(settings.max_prompt_tokens, settings.max_block_hashes,
                    settings.max_prompt_chars)


@cache
def _limited(max_tokens: int, max_hashes: int, max_chars: int) -> type[RouteRequest]:
    return msgspec.defstruct(
        "RouteRequest",
        [("token_ids", documented(
            Annotated[list[TokenId], msgspec.Meta(max_length=max_tokens)] | None, TOKEN_IDS),
          None),
         ("block_hashes", documented(
             Annotated[list[EngineHash], msgspec.Meta(max_length=max_hashes)] | None,
             BLOCK_HASHES), None),
         ("prompt", documented(Annotated[str, msgspec.Meta(max_length=max_chars)] | None,
                               PROMPT), None)],
        bases=(RouteRequest,), forbid_unknown_fields=True, module=__name__,
        namespace={"__doc__": RouteRequest.__doc__})


def inputs_schema(settings: Settings) -> dict[str, Any]:
    """"Exactly one input", as JSON Schema: exactly one of INPUTS is present and not null;
    without a tokenizer the text inputs are refused, so only null is allowed for them."""
    schema: dict[str, Any] = {
        "oneOf": [{"required": [name], "properties": {name: {"not": {"type": "null"}}}}
                  for name in INPUTS]}
    if not settings.tokenizer:
        schema["properties"] = {name: {"type": "null"} for name in sorted(TEXT_INPUTS)}
    return schema


def parse_hash(value: int | str, position: int) -> int | bytes:
    """A block hash as the index keys it: an int, or the bytes of a 32/64-digit hex hash."""
    if isinstance(value, int):
        if not HASH_MIN <= value < HASH_END:
            raise InvalidRequest("an integer block hash must fit in 64 bits (signed or "
                                 "unsigned)", f"block_hashes[{position}]")
        return value
    if not matches(BLOCK_HASH_HEX, value):
        raise InvalidRequest("a block hash string must be hex: up to 16 digits for an integer "
                             "hash, 32 or 64 for a bytes hash", f"block_hashes[{position}]")
    digits = value.removeprefix("0x")
    return int(digits, 16) if len(digits) <= 16 else bytes.fromhex(digits)
