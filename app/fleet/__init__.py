"""The instances kvroute follows: who they are, how they are found, and what following
them costs.

Owns the ``registry`` (every instance and the subscriber tasks that feed the index),
``discovery`` of an instance's event endpoints from its URL, bounded HTTP to instances
(``upstream``), DNS fleets (``dns``), open-file and socket sizing (``limits``), gateway
endpoints, paced registrations and keeping long-lived objects out of the GC.

May import the leaves, ``ingest`` (the subscribers it owns), ``state.format`` and
``index``; never ``routing``, ``http`` or ``epp``.
"""
