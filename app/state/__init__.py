"""Saved state: the index and each worker's stream position, written and resumed.

Owns the blob ``format``, where it is kept (``store``: a file or Valkey), when it is saved
and loaded (``keeper``) and what replicas share through Valkey (``valkey``).

May import the leaves, ``api`` (status answers), ``fleet`` (the keeper saves the
registry's workers) and ``index``; never ``http`` or ``epp``.
"""
