"""One worker's holdings as plain data: what ``PrefixIndex`` saves and restores.

A worker's holdings travel as a sequence of ``Holdings`` pieces of at most a few
thousand blocks each, so that neither taking them from the index nor encoding them holds
the caller's event loop for long. Pieces are msgspec structs (encoded as arrays: compact,
and a field added later is a new version of the format, not a silent misreading).

Invariants of a piece (``PrefixIndex.restore`` checks them and raises ``ValueError``
before changing anything):
- ``hashes``, ``keys`` and ``flags`` have one entry per block: the engine's hash, the
  content key (``index.keys``, 16 bytes) and the node's position bits (first-block flag
  and parent fingerprint, which only depend on the key);
- ``counts`` maps a position in the piece to its reference counts per tier (GPU, CPU,
  STORAGE) where they differ from "stored once on GPU" (the usual case, left out);
- every piece of one worker carries the same ``block_size`` and ``groups``.
"""

from __future__ import annotations

import msgspec

__all__ = ["Holdings"]


class Holdings(msgspec.Struct, array_like=True, frozen=True):
    block_size: int
    groups: list[tuple[int, bool]]  # KV-cache group -> whether it is indexed (full attention)
    hashes: list[int | bytes]
    keys: list[bytes]
    flags: list[int]
    counts: dict[int, tuple[int, int, int]] = {}

    def __len__(self) -> int:
        return len(self.hashes)
