"""The HTTP edge: the FastAPI app, what it refuses before any endpoint runs, its tokens,
the OpenAI-compatible proxy and the dashboard.

May import everything below it (``service``, ``metrics``, the core wings, ``api``, the
leaves); never ``epp``, and nothing below imports it.
"""
