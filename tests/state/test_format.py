"""The saved-state blob and the directory store: whole or nothing, and atomic."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvroute.app.state import format as saved_state
from kvroute.app.state.format import (
    SavedStateError,
    StateWriter,
    WorkerHead,
    decode_state,
    encode_piece,
)
from kvroute.app.state.store import STATE_FILE, DirectoryStore, StateStoreError
from kvroute.index import PrefixIndex

BS = 4


def blob(workers: int = 2) -> bytes:
    index = PrefixIndex()
    writer = StateWriter()
    for n in range(workers):
        worker = (f"vllm-{n}", 0)
        index.apply_stored(worker, [n * 10 + k for k in range(3)], None,
                           list(range(n, n + 3 * BS)), BS)
        pieces = [encode_piece(p) for p in index.capture(worker).pieces(2)]
        writer.add_worker(WorkerHead(*worker, f"tcp://h:{5557 + n}", 41, 1234, False,
                                     len(pieces), 3), pieces)
    return b"".join(writer.finish(saved_at=1000.0))


def test_a_blob_reads_back_whole() -> None:
    state = decode_state(blob())
    assert state.saved_at == 1000.0
    assert sorted(state.workers) == [("vllm-0", 0), ("vllm-1", 0)]
    saved = state.workers[("vllm-1", 0)]
    assert (saved.head.seq, saved.head.fingerprint, saved.head.blocks) == (41, 1234, 3)
    restored = PrefixIndex()
    restored.restore(("vllm-1", 0), saved.pieces)
    assert restored.match(list(range(1, 1 + 3 * BS)))[("vllm-1", 0)].blocks == 3


@pytest.mark.parametrize("damage", ["truncated", "flipped", "empty", "garbage", "appended"])
def test_a_damaged_blob_is_refused_whole(damage: str) -> None:
    good = blob()
    bad = {
        "truncated": good[: len(good) // 2],
        "flipped": good[:40] + bytes([good[40] ^ 0x01]) + good[41:],
        "empty": b"",
        "garbage": bytes(range(256)) * 4,
        "appended": good + b"\0",
    }[damage]
    with pytest.raises(SavedStateError):
        decode_state(bad)


def test_another_format_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(saved_state, "VERSION", 99)
    newer = blob()
    monkeypatch.undo()
    with pytest.raises(SavedStateError, match="version 99"):
        decode_state(newer)


def test_a_sound_checksum_over_unsound_frames_is_refused() -> None:
    """Not the file's fault but a writer's: still refused, still one line."""
    writer = StateWriter()
    writer.add_worker(WorkerHead("a", 0, "tcp://h:1", 1, None, False, 1, 5),
                      [encode_piece(msgspec.msgpack.decode(msgspec.msgpack.encode(
                          saved_state.Holdings(BS, [], [1], [b"k" * 16], [2])),
                          type=saved_state.Holdings))])
    with pytest.raises(SavedStateError, match="5 blocks announced"):
        decode_state(b"".join(writer.finish()))


def test_the_directory_store_replaces_the_file_and_leaves_nothing_else(tmp_path) -> None:
    store = DirectoryStore(tmp_path / "state")

    async def scenario() -> None:
        assert await store.read() is None
        await store.write([b"first"])
        await store.write([b"sec", b"ond"])
        assert await store.read() == b"second"

    asyncio.run(scenario())
    assert [p.name for p in (tmp_path / "state").iterdir()] == [STATE_FILE]


def test_an_unwritable_directory_is_one_clear_error(tmp_path) -> None:
    (tmp_path / "file").write_text("not a directory")
    store = DirectoryStore(tmp_path / "file" / "state")
    with pytest.raises(StateStoreError, match="cannot write"):
        asyncio.run(store.write([b"x"]))
