"""What kvroute's edges take and answer: request bodies, answers, the operation table and
the OpenAPI document built from it, and the decoding of JSON bodies into refusals.

Owns the contract, not its transport: no module here imports FastAPI, gRPC, ``http`` or
``epp``. May import the leaves (``config``, ``workers``, ``errors``, ``patterns``) and
``index``.
"""
