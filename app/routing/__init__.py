"""The routing decision: which worker a prompt should go to, and what that costs.

Owns the cost of each worker (``cost``), the workers a route may weigh (``eligible``),
load read from the instances (``load``), the proxy's and picker's requests in flight
(``inflight``), recent demand and the steady queue, turning text into token ids
(``tokenizer``), predicted-against-served accuracy (``accuracy``) and the decision log.

May import the leaves, ``api`` (the answers it builds), ``fleet`` (the registry it reads)
and ``index``; never ``http`` or ``epp``.
"""
