"""What the proxy reads of an OpenAI request body, and the routing question it asks.

The body itself goes to the instance byte for byte; kvroute reads only `model`,
`cache_salt` and the prompt (`prompt` for completions; for chat, `messages` and the fields
that change how the chat template renders them), decoded with the structs below, which the
OpenAPI document describes. Every other field is the instance's to judge.

A completions `prompt` is text, token ids, or a batch of either; a batch is routed by its
first prompt (vLLM runs a batch on the one instance it reaches). msgspec cannot decode
that union (one array type per union), so `PROMPT_SCHEMA` states it and `_prompt_question`
checks the same rule: nothing in it may be empty, and every token id is in [0, 2**32).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kvroute.app.api.json_body import decode_json, integral_numbers
from kvroute.app.api.route_request import (
    CACHE_SALT,
    CacheSalt,
    ChatMessage,
    ChatTemplateArgs,
    RouteRequest,
    check_messages,
)
from kvroute.app.errors import InvalidRequest, MalformedRequest, split_validation

__all__ = ["PROMPT_SCHEMA", "ChatQuestion", "CompletionQuestion", "route_request_of"]

TOKEN_END = 2**32
_TEXT = {"type": "string", "minLength": 1}
_TOKEN_IDS = {"type": "array", "minItems": 1,
              "items": {"type": "integer", "minimum": 0, "exclusiveMaximum": TOKEN_END}}
PROMPT_SCHEMA = {
    "description": "text, token ids, or a batch of either (routed by its first prompt)",
    "anyOf": [_TEXT, _TOKEN_IDS, {"type": "array", "minItems": 1, "items": _TEXT},
              {"type": "array", "minItems": 1, "items": _TOKEN_IDS}],
}


class CompletionQuestion(msgspec.Struct, forbid_unknown_fields=False):
    """The fields kvroute reads of an OpenAI completions body."""

    prompt: Annotated[Any, msgspec.Meta(extra_json_schema=PROMPT_SCHEMA)]
    model: str | None = None
    cache_salt: Annotated[CacheSalt | None, msgspec.Meta(description=CACHE_SALT)] = None


class ChatQuestion(ChatTemplateArgs, forbid_unknown_fields=False):
    """The fields kvroute reads of an OpenAI chat completions body: the messages, and how
    the chat template renders them."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    model: str | None = None
    cache_salt: Annotated[CacheSalt | None, msgspec.Meta(description=CACHE_SALT)] = None


_QUESTIONS: dict[str, type[CompletionQuestion] | type[ChatQuestion]] = {
    "/v1/completions": CompletionQuestion, "/v1/chat/completions": ChatQuestion}


def route_request_of(path: str, body: bytes,
                     kind: type[RouteRequest] = RouteRequest) -> RouteRequest:
    """The routing question the OpenAI request `body` to `path` asks, as `kind` (the
    service's limits); a MalformedRequest names the body's field at fault."""
    try:
        read = decode_json(body, _QUESTIONS[path])
    except InvalidRequest as exc:  # JSON of the wrong shape: not the request kvroute reads
        raise MalformedRequest(exc.message, exc.field) from None
    question: dict[str, Any] = {"model": read.model, "cache_salt": read.cache_salt}
    where = "messages"
    if isinstance(read, ChatQuestion):
        try:  # the rules the schema states and msgspec cannot check
            check_messages(read.messages)
            question.update(read.template_args())
        except InvalidRequest as exc:
            raise MalformedRequest(exc.message, exc.field) from None
        question["messages"] = read.messages
    else:
        name, value, where = _prompt_question(integral_numbers(read.prompt))
        question[name] = value
    try:
        return msgspec.convert(question, kind)
    except msgspec.ValidationError as exc:
        text, at = split_validation(str(exc))
        at = _body_field(at, where)
        raise MalformedRequest(f"{text} (at `{at}`)" if at else text, at or None) from None


def _body_field(path: str, where: str) -> str:
    """A field of the routing question as the OpenAI body names it: the question's
    `token_ids` or `prompt` is the body's `prompt` (`prompt[0]` for a batch)."""
    for name in ("token_ids", "prompt"):
        if path == name or path.startswith((f"{name}[", f"{name}.")):
            return where + path[len(name):]
    return path


def _prompt_question(prompt: Any) -> tuple[str, Any, str]:
    """`prompt` as (question field, value, where in the body), checked as PROMPT_SCHEMA
    says; a batch is checked whole and routed by its first prompt."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        for number, each in enumerate(prompt):
            _check_one(each, f"prompt[{number}]", type(prompt[0]))
        return ("prompt" if isinstance(prompt[0], str) else "token_ids"), prompt[0], "prompt[0]"
    _check_one(prompt, "prompt", str | list)
    return ("prompt" if isinstance(prompt, str) else "token_ids"), prompt, "prompt"


def _check_one(prompt: Any, where: str, kind: Any) -> None:
    """One prompt of `kind` (str, list, or either): non-empty text or non-empty token ids."""
    if not isinstance(prompt, kind) or not prompt:
        raise MalformedRequest("`prompt` must be non-empty text, a non-empty list of token "
                               "ids, or a batch of one of those", where)
    if isinstance(prompt, list):
        for number, token in enumerate(prompt):
            if type(token) is not int or not 0 <= token < TOKEN_END:
                raise MalformedRequest("token ids must be integers in [0, 2**32)",
                                       f"{where}[{number}]")
