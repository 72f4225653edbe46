"""What the simulated vLLM says on the wire: its chat template and the OpenAI-style bodies.

Shapes follow vLLM's OpenAI server: compact JSON, streamed as ``data: <json>\\n\\n`` events
ending with ``data: [DONE]\\n\\n``; one event per generated token; with
``stream_options.include_usage`` a last event with empty ``choices`` carries the usage. Usage
always includes ``prompt_tokens_details.cached_tokens`` (vLLM needs
``--enable-prompt-tokens-details`` for that; the simulator always reports it).

The chat template is the simulator's own, and ``/tokenize`` applies the same one, so a router
that tokenizes chat messages through ``/tokenize`` sees exactly the tokens the engine sees.
Like a real model's template it renders more of a request than the messages' text (tools,
a message's name and tool calls, template arguments), so a router that drops those fields
tokenizes another prompt than the one the engine caches::

    <|tools|>\n{tools as JSON}\n             when the request has tools
    <|kwargs|>\n{chat_template_kwargs}\n     when it has template arguments (as JSON)
    <|{role}|>\n{name}: {content}{calls}\n   for each message (content parts: their "text"s
                                             joined; "{name}: " when it has a name; each
                                             tool call, and a tool_call_id, as JSON)
    <|assistant|>\n                          when add_generation_prompt is true (the default)

With ``continue_final_message`` the last message is left open (no final newline), and
``add_generation_prompt`` must then be false, as vLLM requires.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from kvroute.sim.engine import RequestOutcome

__all__ = ["chat_prompt", "chat_request_prompt", "completion_body", "sse_events",
           "validate_messages"]


def validate_messages(messages: Any) -> str | None:
    """None when ``messages`` is a chat the template can render, else what is wrong."""
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {role, content} objects"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"messages[{i}] must be an object with a string 'role'"
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(
            isinstance(part, dict) and isinstance(part.get("text", ""), str) for part in content
        ):
            return f"messages[{i}].content must be a string or a list of text parts"
    return None


def chat_prompt(messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                continue_final_message: bool = False, tools: list[Any] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The template above applied to already validated messages."""
    rendered = []
    if tools:
        rendered.append(f"<|tools|>\n{_json(tools)}\n")
    if template_kwargs:
        rendered.append(f"<|kwargs|>\n{_json(template_kwargs)}\n")
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content)
        name = f"{message['name']}: " if isinstance(message.get("name"), str) else ""
        calls = "".join(f"<|tool_call|>{_json(call)}" for call in message.get("tool_calls") or ())
        if message.get("tool_call_id") is not None:
            calls += f"<|tool_call_id|>{_json(message['tool_call_id'])}"
        rendered.append(f"<|{message['role']}|>\n{name}{content or ''}{calls}\n")
    if continue_final_message:
        rendered[-1] = rendered[-1][:-1]
    if add_generation_prompt:
        rendered.append("<|assistant|>\n")
    return "".join(rendered)


def chat_request_prompt(body: dict[str, Any]) -> tuple[str | None, str]:
    """What a chat request body (``/v1/chat/completions`` or ``/tokenize``) renders to:
    ``(None, prompt)``, or ``(problem, field)`` when it cannot be rendered."""
    problem = validate_messages(body.get("messages"))
    if problem:
        return problem, "messages"
    flags = {"add_generation_prompt": True, "continue_final_message": False}
    for flag, default in flags.items():
        value = body.get(flag, default)
        if not isinstance(value, bool):
            return f"'{flag}' must be a boolean", flag
        flags[flag] = value
    if flags["add_generation_prompt"] and flags["continue_final_message"]:
        return ("Cannot set both `continue_final_message` and `add_generation_prompt` to "
                "True."), "continue_final_message"
    tools, kwargs = body.get("tools"), body.get("chat_template_kwargs")
    if tools is not None and not isinstance(tools, list):
        return "'tools' must be a list", "tools"
    if kwargs is not None and not isinstance(kwargs, dict):
        return "'chat_template_kwargs' must be an object", "chat_template_kwargs"
    return None, chat_prompt(body["messages"], flags["add_generation_prompt"],
                             continue_final_message=flags["continue_final_message"],
                             tools=tools, template_kwargs=kwargs)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def _encode(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def _usage(*outcomes: RequestOutcome) -> dict[str, Any]:
    """Token counts of one request, or of a batch's requests together (as vLLM sums them)."""
    prompt = sum(outcome.prompt_tokens for outcome in outcomes)
    completion = sum(len(outcome.output_tokens) for outcome in outcomes)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outcomes)},
    }


def completion_body(chat: bool, response_id: str, created: int, model: str,
                    outcomes: list[RequestOutcome], texts: list[str]) -> bytes:
    """A whole (non-streamed) completion or chat completion: one choice per prompt of a
    batch (a chat has one)."""
    choices: list[dict[str, Any]] = []
    for index, text in enumerate(texts):
        if chat:
            choices.append({"index": index, "message": {"role": "assistant", "content": text},
                            "logprobs": None, "finish_reason": "length", "stop_reason": None})
        else:
            choices.append({"index": index, "text": text, "logprobs": None,
                            "finish_reason": "length", "stop_reason": None,
                            "prompt_logprobs": None})
    kind = "chat.completion" if chat else "text_completion"
    return _encode({"id": response_id, "object": kind, "created": created, "model": model,
                    "choices": choices, "usage": _usage(*outcomes)})


def sse_events(chat: bool, response_id: str, created: int, model: str,
               outcome: RequestOutcome, pieces: list[str], include_usage: bool) -> Iterator[bytes]:
    """The streamed response, one ``data:`` event per generated token (``pieces``)."""
    head = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model}

    def event(payload: dict[str, Any]) -> bytes:
        return b"data: " + _encode(payload) + b"\n\n"

    if chat:
        yield event({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                 "content": ""},
                                          "logprobs": None, "finish_reason": None}]})
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice["delta"] = {"content": piece}
        else:
            choice["text"] = piece
        choice.update(logprobs=None, finish_reason="length" if last else None)
        if last:
            choice["stop_reason"] = None
        yield event({**head, "choices": [choice]})
    if include_usage:
        yield event({**head, "choices": [], "usage": _usage(outcome)})
    yield b"data: [DONE]\n\n"
