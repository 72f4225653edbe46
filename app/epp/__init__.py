"""The gRPC edge: kvroute as a Gateway API Endpoint Picker (Envoy ext_proc), its server,
its messages and its TLS.

May import everything below it (``service``, the core wings, ``api``, the leaves); never
``http``, and nothing below imports it.
"""
