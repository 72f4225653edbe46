"""`kvroute tail` through run(), against the test publisher over loopback TCP."""

from __future__ import annotations

import argparse
import re
import threading

import pytest

from kvroute.app.ingest import tail
from kvroute.app.ingest.wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.sim.publisher import EventPublisher
from tests.support.waiting import scaled, wait_for

# tail's own deadline: longer than any wait below, so the test's waits fail first.
DURATION = str(scaled(90))


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvroute")
    tail.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["tail", *argv])


def stored(*hashes: int, parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent,
                       token_ids=list(range(4 * len(hashes))), block_size=4, medium="GPU")


def run_in_thread(args: argparse.Namespace) -> tuple[threading.Thread, list[int]]:
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(tail.run(args)), daemon=True)
    thread.start()
    return thread, result


def printed_seqs(output: str) -> list[int]:
    return [int(m) for m in re.findall(r"^seq (\d+)", output, re.MULTILINE)]


def test_tail_prints_batches_fills_gaps_by_replay_and_survives_garbage(capsys):
    with EventPublisher(replay_format="new") as pub:
        pub.publish([stored(1, 2, 3)])
        pub.publish([stored(2**64 - 1, parent=3), BlockRemoved(block_hashes=[1])])
        pub.publish([AllBlocksCleared(), stored(-2, parent=None)])
        pub.flush()
        args = parse(pub.endpoint, "--replay", pub.replay_endpoint, "--from-start",
                     "--max-batches", "8", "--duration", DURATION)
        thread, result = run_in_thread(args)
        seen = ""

        def replayed_the_start() -> bool:
            nonlocal seen
            seen += capsys.readouterr().out
            return "seq 2 " in seen

        wait_for(replayed_the_start, "tail to replay the first three batches", interval=0.02)
        pub.drop_live([4])
        pub.publish([stored(10)])                    # 3
        pub.publish([stored(11)])                    # 4: never sent live
        pub.publish_raw(b"\x93\xc1 not msgpack")     # 5: garbage
        pub.publish([BlockRemoved(block_hashes=[10], medium="cpu")])  # 6
        pub.publish([stored(12)])                    # 7

        def finished() -> bool:
            pub.publish([stored(99)])  # keeps the live stream moving until tail has 8
            thread.join(0.05)
            return not thread.is_alive()

        wait_for(finished, "tail to print 8 batches and stop")
    out = seen + capsys.readouterr().out
    assert result == [0]
    assert printed_seqs(out) == list(range(8))  # each batch once, in order
    assert re.search(r"^seq 0 .*rank 0  1 events \(replayed\)$", out, re.MULTILINE)
    assert "BlockStored        3 blocks  0000000000000001..0000000000000003  parent -" in out
    assert "ffffffffffffffff  parent 0000000000000003" in out
    assert "fffffffffffffffe" in out  # a signed hash shown as its 64-bit pattern
    assert "AllBlocksCleared" in out
    assert re.search(r"^! gap: seq \d+\.\.\d+ missing$", out, re.MULTILINE)
    assert re.search(r"^seq 4 .*\(replayed\)$", out, re.MULTILINE)
    assert re.search(r"^seq 5( \(replayed\))?: ! undecodable payload", out, re.MULTILINE)
    assert "BlockRemoved       1 blocks  000000000000000a  medium cpu" in out
    assert re.search(r"^# 8 batches, [1-9]\d* gaps, 0 restarts, 1 malformed$", out, re.MULTILINE)


def test_tail_reports_an_engine_restart_and_old_replay_format(capsys):
    with EventPublisher(replay_format="old", encoding="array") as pub:
        args = parse(pub.endpoint, "--replay", pub.replay_endpoint, "--duration", DURATION,
                     "--max-batches", "4")
        thread, result = run_in_thread(args)
        restarted = False

        def finished() -> bool:
            nonlocal restarted
            pub.publish([stored(7)])
            thread.join(0.05)
            seen = capsys.readouterr().out
            if not restarted and printed_seqs(seen):
                pub.restart()  # seq starts over from 0
                restarted = True
            print(seen, end="")
            return not thread.is_alive()

        wait_for(finished, "tail to print 4 batches and stop")
        assert result == [0]
    out = capsys.readouterr().out
    assert re.search(r"^! seq went back from \d+ to 0: the engine restarted$", out, re.MULTILINE)


def test_ctrl_c_exits_cleanly_with_a_summary(capsys, monkeypatch):
    def interrupted(self, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tail.Tail, "follow", interrupted)
    assert tail.run(parse("tcp://127.0.0.1:9")) == 0
    assert capsys.readouterr().out == "# 0 batches, 0 gaps, 0 restarts, 0 malformed\n"


@pytest.mark.parametrize(("argv", "message"), [
    (("tcp://127.0.0.1:9", "--from-start"), "--from-start needs --replay"),
    (("127.0.0.1:9",), "is not a ZMQ endpoint"),
])
def test_bad_arguments_are_explained(capsys, argv, message):
    assert tail.run(parse(*argv)) == 2
    assert message in capsys.readouterr().err


def test_event_descriptions():
    event = BlockStored(block_hashes=[bytes(range(16)), bytes(2)], parent_block_hash=None,
                        token_ids=[], block_size=0, medium="CPU", lora_name="sql",
                        group_idx=1, kv_cache_spec_kind="sliding_window")
    text = tail.describe_event(event)
    assert "0001020304050607…..0000" in text and "medium CPU" in text
    assert "lora sql" in text and "group 1 sliding_window" in text
    assert tail.describe_event(BlockRemoved(block_hashes=[], group_idx=2)).endswith("group 2")
    assert tail.hash_hex(-1) == "ffffffffffffffff" and tail.hash_hex(None) == "-"
