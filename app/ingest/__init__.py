"""Each worker's KV-event stream into the index, never diverging from the engine.

Owns the wire format (``wire``), the one in-order rule (``sequence``), the ZeroMQ sockets
(``sockets``, ``live_connection``, ``replay_request``, ``replay_channels``), the per-worker
``subscriber``, its ``ledger`` (the worker's status and the one way batches reach its
entries) and its ``replay``, how fleet-wide ingest work is paced (``pacing``,
``budget``) and the apply path (``apply``, ``huge_store``, ``plain_slices``,
``_live_drain``). ``tail`` prints a stream with the same rules.

May import the leaves, ``state.format`` (a subscriber resumes from saved holdings) and
``index``; never ``routing``, ``fleet``, ``http`` or ``epp``.
"""
