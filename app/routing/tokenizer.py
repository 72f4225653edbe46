"""Turning text and chat prompts into the token ids vLLM will see.

Routing on text is only right if kvroute tokenizes exactly as the engine does,
so there are two sources and no guessing:

- `LocalTokenizer`: a Hugging Face `tokenizer.json` (the `tokenizers` library,
  optional extra `kvroute[tokenizer]`). Chat prompts need the model's chat
  template, which only `transformers` can render; without it, chat is refused.
- `InstanceTokenizer`: the vLLM instance's own `POST /tokenize`, which applies
  the served model's tokenizer and chat template, at the price of a round trip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import httpx
import msgspec

from kvroute.app.errors import Conflict, MalformedRequest, TooLarge, UpstreamFailed
from kvroute.app.fleet.upstream import UpstreamError, fetch, tokenize_max_bytes, url_at

__all__ = ["InstanceTokenizer", "LocalTokenizer", "TokenizerError", "Tokenizer", "make_tokenizer"]


class TokenizerError(Exception):
    """The configured tokenizer cannot be loaded (a start-up error, not a request's)."""


class Tokenizer(Protocol):
    async def encode_prompt(self, text: str, *, url: str | None, model: str | None) -> list[int]:
        ...

    async def encode_chat(
        self, messages: list[dict[str, Any]], template_args: dict[str, Any], *,
        url: str | None, model: str | None
    ) -> list[int]:
        """The tokens `messages` render to; `template_args` are the chat request's own
        (route_request.TEMPLATE_ARGS), vLLM's defaults for the ones not given."""
        ...


class LocalTokenizer:
    """A tokenizer.json loaded once; encoding adds the special tokens vLLM adds."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise TokenizerError(
                "a local tokenizer needs the `tokenizers` package: pip install 'kvroute[tokenizer]'"
            ) from None
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            self._tokenizer = HFTokenizer.from_file(str(file))
        except Exception as exc:  # the library raises bare Exceptions for unreadable files
            raise TokenizerError(f"cannot load tokenizer {file}: {exc}") from None
        self._folder = path if path.is_dir() else path.parent
        self._chat: Any = None

    async def encode_prompt(self, text: str, *, url: str | None, model: str | None) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    async def encode_chat(
        self, messages: list[dict[str, Any]], template_args: dict[str, Any], *,
        url: str | None, model: str | None
    ) -> list[int]:
        if self._chat is None:
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise MalformedRequest(
                    "chat messages need the model's chat template: install `transformers` "
                    "or set tokenizer = \"instance\" to use the instance's /tokenize"
                ) from None
            try:
                self._chat = AutoTokenizer.from_pretrained(str(self._folder),
                                                           local_files_only=True)
            except Exception as exc:
                raise MalformedRequest(
                    f"cannot load chat template from {self._folder}: {exc}") from None
        args = dict(template_args)
        add_special_tokens = args.pop("add_special_tokens", False)
        try:
            # As vLLM does: render the text, then tokenize it (special tokens only if asked).
            text = self._chat.apply_chat_template(
                messages, tools=args.pop("tools", None),
                chat_template=args.pop("chat_template", None),
                add_generation_prompt=args.pop("add_generation_prompt", True),
                continue_final_message=args.pop("continue_final_message", False),
                tokenize=False, **args.pop("chat_template_kwargs", None) or {})
            ids = self._chat.encode(text, add_special_tokens=add_special_tokens)
        except Exception as exc:  # jinja errors for malformed messages
            raise MalformedRequest(f"messages: cannot apply the chat template: {exc}") from None
        return list(ids)


class _TokenizeAnswer(msgspec.Struct):
    """The part of vLLM's `/tokenize` answer kvroute reads."""

    tokens: list[int]


class _ErrorAnswer(msgspec.Struct):
    """vLLM's OpenAI-style error answer: `{"error": {"message": ...}}`, or the older flat
    `{"message": ...}`."""

    error: dict[str, Any] | None = None
    message: str | None = None


def _error_message(body: bytes) -> str | None:
    """The `message` of a vLLM error answer, cut to 300 characters; None for anything else."""
    try:
        answer = msgspec.json.decode(body, type=_ErrorAnswer)
    except (ValueError, RecursionError):
        return None
    message = (answer.error or {}).get("message", answer.message)
    return message[:300] if isinstance(message, str) else None


class InstanceTokenizer:
    """Asks an instance's `/tokenize`; its failures are `UpstreamFailed` naming the instance.

    Each call is bounded (`app.fleet.upstream.fetch`): the whole answer within `timeout` seconds,
    and within the bytes that `max_prompt_tokens` tokens take. A larger answer holds more
    tokens than any prompt is allowed, so it is the prompt's `TooLarge`, as a counted one
    would be; a slow, broken or unreachable instance is `UpstreamFailed`, and the service
    asks the next one."""

    def __init__(self, client: httpx.AsyncClient, timeout: float = 10.0, *,
                 max_prompt_tokens: int) -> None:
        self._client = client
        self._timeout = timeout
        self._max_prompt_tokens = max_prompt_tokens
        self._max_bytes = tokenize_max_bytes(max_prompt_tokens)

    async def _tokenize(self, url: str | None, body: dict[str, Any]) -> list[int]:
        if url is None:
            # The eligible instances were registered without a url: asking again cannot help,
            # registering one with its url (or sending token ids) does.
            raise Conflict("no eligible instance has an HTTP `url` to ask /tokenize: send "
                           "token_ids, or register the instance with its url")
        try:
            answer = await fetch(self._client, "POST", url_at(url, "/tokenize"), json=body,
                                 max_bytes=self._max_bytes, deadline=self._timeout)
        except UpstreamError as exc:
            if exc.kind == "too_large":
                raise TooLarge(f"the prompt is over the limit of {self._max_prompt_tokens} "
                               f"tokens ({url}: {exc})") from None
            raise UpstreamFailed(f"{url}: {exc}") from None
        if answer.status >= 500:
            raise UpstreamFailed(f"{url}/tokenize answered {answer.status}")
        if answer.status >= 400:
            # The instance refusing the prompt (4xx) is the prompt's fault, not the instance's.
            # vLLM's error message says why; nothing else of the answer is repeated.
            reason = _error_message(answer.body)
            raise MalformedRequest(f"{url}/tokenize answered {answer.status}"
                                   + (f": {reason}" if reason else ""))
        try:
            # Decoding into the declared type checks every token in C: an answer of the
            # largest size costs a few ms of the event loop, not a Python loop over it.
            return msgspec.json.decode(answer.body, type=_TokenizeAnswer).tokens
        except (ValueError, RecursionError):  # msgspec.DecodeError is a ValueError
            raise UpstreamFailed(f"{url}/tokenize gave no `tokens` list of integers") from None

    async def encode_prompt(self, text: str, *, url: str | None, model: str | None) -> list[int]:
        body: dict[str, Any] = {"prompt": text}
        if model:
            body["model"] = model
        return await self._tokenize(url, body)

    async def encode_chat(
        self, messages: list[dict[str, Any]], template_args: dict[str, Any], *,
        url: str | None, model: str | None
    ) -> list[int]:
        body: dict[str, Any] = {"messages": messages, **template_args}
        if model:
            body["model"] = model
        return await self._tokenize(url, body)


def make_tokenizer(setting: str | None, client: httpx.AsyncClient, *,
                   max_prompt_tokens: int) -> Tokenizer | None:
    """The tokenizer a `tokenizer` setting names, or None when text is not accepted."""
    if setting is None:
        return None
    if setting == "instance":
        return InstanceTokenizer(client, max_prompt_tokens=max_prompt_tokens)
    return LocalTokenizer(setting)
