"""Reading a /metrics page in tests: the one parser is prometheus_client's own."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

_MISSING: Any = object()


def values(text: str, name: str, **labels: str) -> list[float]:
    """The values of the samples named `name` whose labels include `labels`."""
    return [sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()]


def metric(http: httpx.Client, name: str, default: Any = _MISSING, **labels: str) -> Any:
    """The one sample of kvroute's /metrics named `name` with `labels` among its labels;
    `default` when there is none (without one, that fails), and a failure when several
    match."""
    found = values(http.get("/metrics").text, name, **labels)
    if not found and default is not _MISSING:
        return default
    assert len(found) == 1, (name, labels, found)
    return found[0]
