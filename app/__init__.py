"""kvroute service: wire decoding, subscribers, registry, scoring, HTTP API, CLI."""
