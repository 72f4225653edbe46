"""kvroute, the service: KV events in from every vLLM worker, routing answers out.

Wings (one package each; an arrow is "may import"):

- ``ingest``: a worker's event stream into the index (wire format, the in-order rule,
  subscriber, replay, ZeroMQ sockets, the apply path) and ``kvroute tail``.
- ``routing``: the decision (cost of each eligible worker, load, requests in flight,
  recent demand, steady queue, tokenizer, prediction accuracy, decision log).
- ``fleet``: the instances followed (registry, discovery, upstream HTTP, DNS fleets,
  open-file limits, gateway endpoints, paced registrations).
- ``state``: saved state (format, store, keeper, Valkey).
- ``api``: what the HTTP and gRPC edges take and answer (request bodies, answers, the
  operation table, the OpenAPI document, body decoding).
- ``http``: the FastAPI app, its guard and tokens, the OpenAI proxy and the dashboard.
- ``epp``: the gRPC Endpoint Picker (Envoy ext_proc).

Leaves at this level, importing no wing: ``config``, ``workers`` (the fleet-wide
vocabulary: ``WorkerKey``, states, counters), ``errors`` (the exception tree),
``patterns`` (string rules of fields) and ``tasks``. ``service`` and ``metrics`` sit above
the core wings and below the edges; ``server`` is the composition root (the service, the
HTTP server and the Endpoint Picker side by side) and ``cli`` its command line.

The arrows point one way: ``http`` and ``epp`` import neither each other nor anything that
imports them, and the core wings import neither; ``index`` (the pure prefix index) imports
nothing of ``app``. ``make lint`` checks these contracts (import-linter, pyproject.toml).
"""
