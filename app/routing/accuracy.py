"""Predicted against actual prefix-cache hits, for the requests the proxy forwards.

For each forwarded request kvroute predicted how many prompt tokens the chosen worker
would serve from its cache (the decision's `matched_tokens`); vLLM started with
`--enable-prompt-tokens-details` reports the truth in the answer's
`usage.prompt_tokens_details.cached_tokens`. `UsageScanner` finds that figure in the
relayed bytes as they pass (non-streamed JSON, or the usage event of a stream), and
`HitAccuracy` counts both sides and their difference per worker.

Invariants:

- The scanner never changes, holds back or copies the relayed bytes: it looks at each
  chunk once and keeps at most `CARRY` bytes of it, so a value split between two chunks
  is still found and memory stays bounded whatever the answer's size.
- Only what a JSON key can say is read: a key is followed by `:`, and a generated text
  (a JSON string) cannot contain an unescaped `"`, so text that merely quotes
  `"cached_tokens": 5` is never taken for the usage. The last usage of the answer wins
  (a stream with `continuous_usage_stats` reports a running one per event).
- Every request the proxy relays is recorded exactly once by `HitWatch.finish`: compared
  (predicted, actual, difference), or counted as unavailable with one reason.
- A comparison is only made when vLLM counted the same prompt tokens kvroute routed on;
  otherwise (a batch, whose usage sums every prompt; a tokenizer that disagrees with the
  engine's) the prediction is not about the same prompt and is counted `prompt_mismatch`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvroute.app.workers import WorkerKey

__all__ = ["CARRY", "REASONS", "HitAccuracy", "HitTotals", "HitWatch", "UsageScanner"]

# Bytes of each chunk kept for the next one: more than the longest match below.
CARRY = 2048
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
# A number is taken only once what follows it shows it complete (no digit cut off).
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d{1,12})(?=\s*[,}])')
_CACHED_TOKENS = re.compile(
    rb'"prompt_tokens_details"\s*:\s*\{[^{}]{0,512}?"cached_tokens"\s*:\s*(\d{1,12})(?=\s*[,}])')

# Why a forwarded request has no comparison.
REASONS = {
    "no_usage": "the answer carried no usage (a stream without "
                "`stream_options.include_usage`)",
    "no_details": "the usage had no `prompt_tokens_details.cached_tokens` (vLLM runs "
                  "without `--enable-prompt-tokens-details`)",
    "prompt_mismatch": "vLLM counted other prompt tokens than kvroute routed on (a batch, "
                       "or a tokenizer that disagrees with the engine's)",
    "error": "the instance answered with a status other than 2xx, or broke before answering",
    "incomplete": "the answer did not end (the client left, or the instance broke off)",
    "compressed": "the answer was compressed (the client asked for an encoding)",
}

# (actual - predicted) in tokens: 0 is a bucket of its own, then both ways alike.
_EDGES = (1, 16, 64, 256, 1024, 4096, 16384)
DIFFERENCE_BUCKETS = (*(-e - 0.5 for e in reversed(_EDGES)), -0.5, 0.5,
                      *(e + 0.5 for e in _EDGES), float("inf"))


class UsageScanner:
    """Finds the usage's prompt and cached tokens in an answer fed chunk by chunk."""

    __slots__ = ("_carry", "saw_usage", "prompt_tokens", "cached_tokens")

    def __init__(self) -> None:
        self._carry = b""
        self.saw_usage = False
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None

    def feed(self, chunk: bytes) -> None:
        window = self._carry + chunk if self._carry else chunk
        self._carry = window[-CARRY:]
        # The literal search runs at memchr speed; the expressions only where it hits.
        if b'"usage"' in window:
            self.saw_usage = self.saw_usage or _USAGE.search(window) is not None
        if b'"prompt_tokens"' in window:
            self.prompt_tokens = _last(_PROMPT_TOKENS, window, self.prompt_tokens)
        if b'"cached_tokens"' in window:
            self.cached_tokens = _last(_CACHED_TOKENS, window, self.cached_tokens)


def _last(pattern: re.Pattern[bytes], window: bytes, known: int | None) -> int | None:
    """The number of `pattern`'s last match in `window`, else what was `known` before."""
    for match in pattern.finditer(window):
        known = int(match.group(1))
    return known


@dataclass(slots=True)
class HitTotals:
    """One worker's comparisons so far (the dashboard shows them; Prometheus has the same)."""

    requests: int = 0  # compared
    exact: int = 0  # compared, and the difference was 0
    predicted: int = 0
    actual: int = 0
    unavailable: int = 0


class HitAccuracy:
    """The predicted-vs-actual metrics of one service, and their totals per worker."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["instance", "dp_rank"]
        self.predicted = Counter(
            "kvroute_predicted_cached_tokens", "prompt tokens kvroute predicted the chosen "
            "worker would serve from its cache, over compared proxied requests",
            labelnames=labels, registry=registry)
        self.actual = Counter(
            "kvroute_actual_cached_tokens", "prompt tokens vLLM reported served from its "
            "cache (usage.prompt_tokens_details.cached_tokens), over compared proxied requests",
            labelnames=labels, registry=registry)
        self.difference = Histogram(
            "kvroute_cached_tokens_difference", "actual - predicted cached tokens per "
            "compared proxied request (0: kvroute was exactly right)",
            labelnames=labels, buckets=DIFFERENCE_BUCKETS, registry=registry)
        self.unavailable = Counter(
            "kvroute_cached_tokens_unavailable", "proxied requests whose cached tokens could "
            "not be compared, by reason", labelnames=[*labels, "reason"], registry=registry)
        self.totals: dict[WorkerKey, HitTotals] = {}

    def compared(self, key: WorkerKey, predicted: int, actual: int) -> None:
        labels = (key[0], str(key[1]))
        self.predicted.labels(*labels).inc(predicted)
        self.actual.labels(*labels).inc(actual)
        self.difference.labels(*labels).observe(actual - predicted)
        totals = self.totals.setdefault(key, HitTotals())
        totals.requests += 1
        totals.exact += actual == predicted
        totals.predicted += predicted
        totals.actual += actual

    def not_compared(self, key: WorkerKey, reason: str) -> None:
        assert reason in REASONS, reason
        self.unavailable.labels(key[0], str(key[1]), reason).inc()
        self.totals.setdefault(key, HitTotals()).unavailable += 1

    def forget(self, keys: set[WorkerKey]) -> None:
        """Drop the dashboard totals of workers no longer followed (Prometheus keeps its
        counters: a scraper handles series that stop)."""
        for key in set(self.totals) - keys:
            del self.totals[key]

    def watch(self, key: WorkerKey, predicted: int, prompt_tokens: int,
              reported: Callable[[int], None] | None = None) -> HitWatch:
        """A watch for one forwarded request; `reported` hears the cached tokens of an
        answer that is compared."""
        return HitWatch(self, key, predicted, prompt_tokens, reported)


class HitWatch:
    """One forwarded request: `start` with the answer's status and encoding, `feed` the
    relayed chunks, `finish` once however the relay ended. Never raises into the relay."""

    __slots__ = ("_accuracy", "key", "predicted", "prompt_tokens", "_scanner", "_verdict",
                 "_done", "_reported")

    def __init__(self, accuracy: HitAccuracy, key: WorkerKey, predicted: int,
                 prompt_tokens: int, reported: Callable[[int], None] | None = None) -> None:
        self._accuracy = accuracy
        self._reported = reported
        self.key = key
        self.predicted = predicted
        self.prompt_tokens = prompt_tokens
        self._scanner: UsageScanner | None = None
        self._verdict: str | None = None  # a reason decided before any byte is read
        self._done = False

    def start(self, status: int, content_encoding: str | None) -> None:
        if not 200 <= status < 300:
            self._verdict = "error"
        elif content_encoding not in (None, "", "identity"):
            self._verdict = "compressed"
        else:
            self._scanner = UsageScanner()

    def feed(self, chunk: bytes) -> None:
        if self._scanner is not None:
            self._scanner.feed(chunk)

    def finish(self, complete: bool, reason: str | None = None) -> None:
        """Record the request once: `complete` when the whole answer was relayed; `reason`
        overrides (the proxy's own failures before any answer)."""
        if self._done:
            return
        self._done = True
        reason = reason or self._verdict or (None if complete else "incomplete")
        scanner = self._scanner
        if reason is None and scanner is not None:
            if not scanner.saw_usage:
                reason = "no_usage"
            elif scanner.cached_tokens is None:
                reason = "no_details"
            elif scanner.prompt_tokens != self.prompt_tokens:
                reason = "prompt_mismatch"
            else:
                self._accuracy.compared(self.key, self.predicted, scanner.cached_tokens)
                if self._reported is not None:
                    self._reported(scanner.cached_tokens)
                return
        self._accuracy.not_compared(self.key, reason or "incomplete")
