"""The saved-state format: every worker's holdings and where its stream stood, in one blob.

A blob is a run of frames, each a 4-byte big-endian length and a msgpack body:

1. a ``Header`` (magic, format version, when it was saved, how many workers);
2. per worker a ``WorkerHead`` (which worker, which endpoint, the last applied seq and a
   fingerprint of that batch's payload, whether it was degraded, how many pieces), then
   that many ``Holdings`` pieces (``index.holdings``);
3. a footer: the xxh3-64 checksum of every byte before it.

Invariants:
- A blob is read whole or not at all: ``decode_state`` checks the length of every frame,
  the footer's checksum and the version before it returns anything, and raises
  ``SavedStateError`` (one line, saying what is wrong) otherwise. A torn write, a corrupt
  byte, a file of another program or of another format version never loads half.
- What identifies the engine a worker's holdings came from is the fingerprint of the last
  batch applied: a replay that starts with a batch of that seq and that fingerprint comes
  from the same engine, and then the holdings are exact at that seq.
- Frames are small (a piece is at most ``PIECE_BLOCKS`` blocks), so that encoding one
  never holds the event loop for long; a worker's frames can be carried into the next
  blob unchanged (``SavedWorker.frames``) while its instance has not come back.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field

import msgspec
from xxhash import xxh3_64, xxh3_64_intdigest

from kvroute.app.workers import WorkerKey
from kvroute.index.holdings import Holdings

__all__ = [
    "PIECE_BLOCKS", "SavedState", "SavedStateError", "SavedWorker", "StateWriter",
    "WorkerHead", "decode_state", "payload_fingerprint",
]

MAGIC = "kvroute-state"
VERSION = 1
PIECE_BLOCKS = 8192  # few enough that making and encoding one piece holds the loop briefly
_LENGTH = struct.Struct(">I")
_FOOTER_BYTES = 8


class SavedStateError(Exception):
    """A blob that cannot be loaded; the message says why in one line."""


class Header(msgspec.Struct, array_like=True, frozen=True):
    magic: str
    version: int
    saved_at: float  # unix time
    workers: int


class WorkerHead(msgspec.Struct, array_like=True, frozen=True):
    instance_id: str
    dp_rank: int
    endpoint: str
    seq: int
    fingerprint: int | None  # None: the last batch's payload is not known
    degraded: bool
    pieces: int
    blocks: int
    # Then this many pieces of blocks that were unconfirmed, for this many more seconds.
    unconfirmed_pieces: int = 0
    unconfirmed_for: float = 0.0

    @property
    def worker(self) -> WorkerKey:
        return (self.instance_id, self.dp_rank)


@dataclass(slots=True)
class SavedWorker:
    head: WorkerHead
    pieces: list[Holdings]
    unconfirmed: list[Holdings] = field(default_factory=list)
    saved_at: float = 0.0  # unix time
    frames: list[bytes] = field(default_factory=list, repr=False)  # as read, for carrying

    def unconfirmed_left(self, now: float) -> float:
        """Seconds its unconfirmed blocks still count, at unix time ``now``."""
        return max(0.0, self.head.unconfirmed_for - max(0.0, now - self.saved_at))


@dataclass(slots=True)
class SavedState:
    saved_at: float
    workers: dict[WorkerKey, SavedWorker]
    size: int  # bytes

    @property
    def blocks(self) -> int:
        return sum(saved.head.blocks for saved in self.workers.values())


def payload_fingerprint(payload: bytes | memoryview) -> int:
    """What a saved worker remembers of its last batch (stable across processes, unlike
    ``hash()``)."""
    return xxh3_64_intdigest(payload)


_encode = msgspec.msgpack.Encoder().encode
_header_decoder = msgspec.msgpack.Decoder(Header)
_head_decoder = msgspec.msgpack.Decoder(WorkerHead)
_piece_decoder = msgspec.msgpack.Decoder(Holdings)


def _frame(body: bytes) -> bytes:
    return _LENGTH.pack(len(body)) + body


class StateWriter:
    """Builds a blob frame by frame; ``finish`` returns its chunks (header first)."""

    def __init__(self) -> None:
        self._frames: list[bytes] = []
        self._workers = 0

    def add_worker(self, head: WorkerHead, pieces: list[bytes]) -> None:
        """A worker's head and its already encoded pieces (``encode_piece``): the held
        ones, then the unconfirmed ones."""
        if len(pieces) != head.pieces + head.unconfirmed_pieces:
            raise ValueError(f"{head.pieces} + {head.unconfirmed_pieces} pieces announced, "
                             f"{len(pieces)} given")
        self._frames.append(_frame(_encode(head)))
        self._frames.extend(pieces)
        self._workers += 1

    def carry(self, saved: SavedWorker) -> None:
        """A worker from an earlier blob, unchanged."""
        self._frames.extend(saved.frames)
        self._workers += 1

    def finish(self, saved_at: float | None = None) -> list[bytes]:
        header = _frame(_encode(Header(MAGIC, VERSION, time.time() if saved_at is None
                                       else saved_at, self._workers)))
        chunks = [header, *self._frames]
        checksum = xxh3_64()
        for chunk in chunks:
            checksum.update(chunk)
        chunks.append(checksum.digest())
        return chunks


def encode_piece(piece: Holdings) -> bytes:
    return _frame(_encode(piece))


def decode_state(blob: bytes) -> SavedState:
    """The state in ``blob``; raises ``SavedStateError`` unless all of it is sound."""
    if len(blob) < _LENGTH.size + _FOOTER_BYTES:
        raise SavedStateError(f"{len(blob)} bytes is too short to be saved state")
    body, footer = memoryview(blob)[:-_FOOTER_BYTES], blob[-_FOOTER_BYTES:]
    if xxh3_64(body).digest() != footer:
        raise SavedStateError("checksum mismatch: the file is truncated or corrupt")
    frames = _split(body)
    try:
        header = _header_decoder.decode(frames[0])
    except msgspec.DecodeError:
        raise SavedStateError("not a kvroute saved state (no header)") from None
    if header.magic != MAGIC:
        raise SavedStateError("not a kvroute saved state (wrong magic)")
    if header.version != VERSION:
        raise SavedStateError(f"format version {header.version}; this kvroute reads "
                              f"version {VERSION}")
    workers: dict[WorkerKey, SavedWorker] = {}
    position = 1
    try:
        for _ in range(header.workers):
            head = _head_decoder.decode(frames[position])
            first = position
            position += 1 + head.pieces + head.unconfirmed_pieces
            if position > len(frames):
                raise SavedStateError("a worker's pieces run past the end")
            pieces = [_piece_decoder.decode(frame) for frame in frames[first + 1:position]]
            held, unconfirmed = pieces[:head.pieces], pieces[head.pieces:]
            if sum(len(piece) for piece in held) != head.blocks:
                raise SavedStateError(f"worker {head.worker}: {head.blocks} blocks "
                                      "announced, its pieces differ")
            workers[head.worker] = SavedWorker(
                head, held, unconfirmed, header.saved_at,
                [_frame(bytes(frame)) for frame in frames[first:position]])
    except (msgspec.DecodeError, IndexError) as exc:
        raise SavedStateError(f"a frame does not decode: {exc}") from None
    if position != len(frames):
        raise SavedStateError(f"{len(frames) - position} frames after the last worker")
    return SavedState(header.saved_at, workers, len(blob))


def _split(body: memoryview) -> list[memoryview]:
    frames = []
    offset = 0
    while offset < len(body):
        if offset + _LENGTH.size > len(body):
            raise SavedStateError("a frame length is cut off")
        (length,) = _LENGTH.unpack_from(body, offset)
        offset += _LENGTH.size
        if offset + length > len(body):
            raise SavedStateError("a frame runs past the end")
        frames.append(body[offset:offset + length])
        offset += length
    if not frames:
        raise SavedStateError("no frames")
    return frames
