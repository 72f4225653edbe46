"""The bodies of `POST /v1/route` (and the routing question the proxy asks for an OpenAI
request) and of `POST /v1/match`: msgspec structs that requests are decoded with and that
the OpenAPI document describes. A route request is a match request (the prompt and which
workers may answer) plus what only a route does with it.

Invariants:
- `route_request_type(settings)` is `RouteRequest` with the settings' size limits in its
  field types (`match_request_type(settings)` is `MatchRequest` with them), so msgspec
  refuses a longer `token_ids`, `block_hashes` or `prompt` while decoding (a 422 naming the
  field) and the schema states the same maxima.
- A rule JSON Schema can state but msgspec cannot check is written once here as schema and
  checked by the service with the same constant: the block-hash pattern and integer range
  (`parse_hash`), "exactly one input" (`Service._lookup`), a message's fields
  (`check_messages`), `continue_final_message` against `add_generation_prompt`
  (`CONTINUE_RULE`).
- A chat message reaches the tokenizer whole, with the request's template arguments
  (`ChatTemplateArgs`): what a chat template renders is not only roles and text.
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType

from kvroute.app.config import Settings
from kvroute.app.errors import InvalidRequest, TooLarge
from kvroute.app.patterns import BLOCK_HASH_HEX, INSTANCE_ID, described, documented, matches

__all__ = ["CONTINUE_RULE", "INPUTS", "TEMPLATE_ARGS", "ChatMessage", "ChatTemplateArgs",
           "MatchRequest", "RouteRequest", "check_messages", "inputs_schema",
           "match_request_type", "parse_hash", "route_request_type"]

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
# vLLM block hashes: signed (older versions) or unsigned 64-bit ints, or hex strings. msgspec
# bounds cannot span both ranges, so `parse_hash` checks them.
HASH_MIN, HASH_END = -(2**63), 2**64
IntHash = Annotated[int, msgspec.Meta(
    extra_json_schema={"minimum": HASH_MIN, "exclusiveMaximum": HASH_END})]
EngineHash = IntHash | described(str, BLOCK_HASH_HEX)
# A content part's `text`, when it has one, is text (checked with the prompt's size).
CONTENT_PART = {"type": "object", "properties": {"text": {"type": "string"}}}
# A candidate that is not a registered instance's id is a 404.
InstanceId = described(str, INSTANCE_ID)

# The prompt, given exactly one way; the last two need a tokenizer.
INPUTS = ("token_ids", "block_hashes", "prompt", "messages")
TEXT_INPUTS = frozenset({"prompt", "messages"})


# An OpenAI chat message, kept as it came: a chat template may render any of its fields
# (`name`, `tool_calls`, `tool_call_id`, ...), so all of them reach the tokenizer, as they
# reach vLLM. msgspec keeps it a dict; `check_messages` checks what this schema states.
MESSAGE_SCHEMA: dict[str, Any] = {
    "title": "ChatMessage",
    "description": "an OpenAI chat message; every field goes to the chat template",
    "required": ["role"],
    "properties": {
        "role": {"type": "string"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": CONTENT_PART},
                              {"type": "null"}]},
    },
}
ChatMessage = Annotated[dict[str, Any], msgspec.Meta(extra_json_schema=MESSAGE_SCHEMA)]

# The chat request's fields that change what its messages render to (vLLM's chat
# completions and /tokenize read the same ones); one not given keeps vLLM's default.
TEMPLATE_ARGS = ("add_generation_prompt", "continue_final_message", "add_special_tokens",
                 "chat_template", "chat_template_kwargs", "tools")


# vLLM refuses to leave the last message open and also open the assistant's turn, and the
# second is on unless turned off: continue_final_message true needs add_generation_prompt
# false, given.
CONTINUE_RULE: dict[str, Any] = {
    "if": {"required": ["continue_final_message"],
           "properties": {"continue_final_message": {"const": True}}},
    "then": {"required": ["add_generation_prompt"],
             "properties": {"add_generation_prompt": {"const": False}}},
}


class ChatTemplateArgs(msgspec.Struct, kw_only=True):
    """How `messages` are rendered, as in an OpenAI chat request (read with `messages`
    only; the other inputs are already the prompt). The flags are not nullable: vLLM
    refuses a null one in a chat request, which the proxy forwards as it came."""

    add_generation_prompt: documented(bool | UnsetType, "end with the assistant's turn "
                                                        "opening (vLLM's default: true)") = UNSET
    continue_final_message: documented(bool | UnsetType, "leave the last message open "
                                                         "(vLLM's default: false)") = UNSET
    add_special_tokens: documented(bool | UnsetType, "add special tokens besides the "
                                                     "template's (vLLM's default: false)"
                                   ) = UNSET
    chat_template: documented(str | None, "a template of the request's own") = None
    chat_template_kwargs: documented(dict[str, Any] | None,
                                     "arguments the template reads") = None
    tools: documented(list[dict[str, Any]] | None, "the tools offered to the model") = None

    def template_args(self) -> dict[str, Any]:
        """The arguments given, as the chat request names them; CONTINUE_RULE checked."""
        given = {name: value for name in TEMPLATE_ARGS
                 if (value := getattr(self, name)) is not None and value is not UNSET}
        if given.get("continue_final_message") and given.get("add_generation_prompt", True):
            raise InvalidRequest("`continue_final_message` leaves the last message open: it "
                                 "needs `add_generation_prompt` false", "add_generation_prompt")
        return given


def check_messages(messages: list[dict[str, Any]], max_chars: int | None = None) -> None:
    """What MESSAGE_SCHEMA states (a string `role`; `content` a string, a list of parts
    whose `text` is a string, or null), and the messages' text within `max_chars`."""
    chars = 0
    for number, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise InvalidRequest("a message's `role` must be a string", f"messages[{number}].role")
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part_number, part in enumerate(content):
                at = f"messages[{number}].content[{part_number}]"
                if not isinstance(part, dict):
                    raise InvalidRequest("a content part must be an object", at)
                text = part.get("text", "")
                if not isinstance(text, str):
                    raise InvalidRequest("a content part's `text` must be a string",
                                         f"{at}.text")
                chars += len(text)
        elif content is not None:
            raise InvalidRequest("a message's `content` is a string, a list of parts or null",
                                 f"messages[{number}].content")
    if max_chars is not None and chars > max_chars:
        raise TooLarge(f"the messages hold {chars} characters, over the limit of {max_chars}",
                       "messages")


#: The longest ``cache_salt`` kvroute takes (vLLM sets no bound; a salt names a tenant).
CACHE_SALT_MAX_CHARS = 1024
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=CACHE_SALT_MAX_CHARS)]
CACHE_SALT = ("the tenant's `cache_salt`, as sent to vLLM: only blocks cached under it match "
              "(and it matches no other tenant's, nor unsalted blocks)")

# What each input is, for people (the limited fields of route_request_type say it too).
TOKEN_IDS = "the prompt's token ids (at most `max_prompt_tokens`)"
BLOCK_HASHES = ("vLLM's block hashes of the prompt: 64-bit ints, signed or not, or hex "
                "strings (at most `max_block_hashes`)")
PROMPT = "text, tokenized as the instance would (at most `max_prompt_chars` characters)"


class MatchRequest(ChatTemplateArgs, forbid_unknown_fields=True):
    """Exactly one of `token_ids`, `block_hashes`, `prompt` (text) or `messages` (chat), and
    which workers may answer: the question `POST /v1/match` answers and a route asks first."""

    token_ids: documented(list[TokenId] | None, TOKEN_IDS) = None
    block_hashes: documented(list[EngineHash] | None, BLOCK_HASHES) = None
    prompt: documented(str | None, PROMPT) = None
    messages: documented(Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] | None,
                         "a chat, rendered with the model's chat template") = None
    model: documented(str | None, "only instances serving it (a LoRA adapter's name "
                                  "matches the blocks cached for it)") = None
    lora_name: documented(str | None, "the LoRA adapter the blocks were cached under") = None
    cache_salt: documented(CacheSalt | None, CACHE_SALT) = None
    candidates: documented(
        Annotated[list[InstanceId], msgspec.Meta(min_length=1)] | None,
        "only these instances (ids)") = None


class RouteRequest(MatchRequest, forbid_unknown_fields=True):
    """Exactly one of `token_ids`, `block_hashes`, `prompt` (text) or `messages` (chat)."""

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
    return _limited(RouteRequest, settings.max_prompt_tokens, settings.max_block_hashes,
                    settings.max_prompt_chars)


def match_request_type(settings: Settings) -> type[MatchRequest]:
    """MatchRequest with `settings`' limits on the prompt's length."""
    return _limited(MatchRequest, settings.max_prompt_tokens, settings.max_block_hashes,
                    settings.max_prompt_chars)


@cache
def _limited(kind: type[MatchRequest], max_tokens: int, max_hashes: int, max_chars: int,
             ) -> type[MatchRequest]:
    return msgspec.defstruct(
        kind.__name__,
        [("token_ids", documented(
            Annotated[list[TokenId], msgspec.Meta(max_length=max_tokens)] | None, TOKEN_IDS),
          None),
         ("block_hashes", documented(
             Annotated[list[EngineHash], msgspec.Meta(max_length=max_hashes)] | None,
             BLOCK_HASHES), None),
         ("prompt", documented(Annotated[str, msgspec.Meta(max_length=max_chars)] | None,
                               PROMPT), None)],
        bases=(kind,), forbid_unknown_fields=True, module=__name__,
        namespace={"__doc__": kind.__doc__})


def inputs_schema(settings: Settings) -> dict[str, Any]:
    """"Exactly one input", as JSON Schema: exactly one of INPUTS is present and not null;
    without a tokenizer the text inputs are refused, so only null is allowed for them."""
    schema: dict[str, Any] = {
        "oneOf": [{"required": [name], "properties": {name: {"not": {"type": "null"}}}}
                  for name in INPUTS], **CONTINUE_RULE}
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
