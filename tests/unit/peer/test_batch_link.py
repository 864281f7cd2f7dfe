"""``BatchLink``: a turn's ring steps leave as one frame, and each session hears only its own news.

The next peer is a scripted handler on an in-memory stream (``transport/memory.py``) that reads
PushBatch frames and answers as the test says; the real peer's side is covered with peer
processes in ``tests/integration/test_push.py``.
"""

from __future__ import annotations

import asyncio

import msgspec
import torch

from p2pserve.peer.batch_link import BatchLink, Watch, _Item, frames_of
from p2pserve.protocol import (
    SESSION_PROTOCOL,
    ErrorReply,
    Forward,
    FrameLimits,
    PushBatch,
    PushBatchAck,
    PushForward,
    PushHop,
    decode_request,
)
from p2pserve.transport.frames import read_frame, tensor_to_wire, write_frame
from p2pserve.transport.memory import MemoryNetwork

LIMITS = FrameLimits()


def _step(sid: str, step: int = 1, route=()) -> tuple[PushForward, bytes]:
    meta, data = tensor_to_wire(torch.tensor([7], dtype=torch.int64))
    return PushForward(forward=Forward(session_id=sid, step=step, position=5, tensor=meta), route=list(route),
                       ring=True), bytes(data)


class Heard:
    """What each session's watch heard."""

    def __init__(self):
        self.failed: dict[str, list[ErrorReply]] = {}
        self.broken: list[str] = []

    def watch(self, sid: str) -> Watch:
        return Watch(owner=sid, failed=lambda r: self.failed.setdefault(sid, []).append(r),
                     broken=lambda: self.broken.append(sid))


async def _link(answer):
    """A BatchLink to a next peer whose handler calls ``answer(batch, payload, writer)`` per frame;
    returns (link, the batches it got)."""
    net = MemoryNetwork()
    got: list[tuple[PushBatch, bytes]] = []

    async def handler(reader, writer, remote):
        try:
            while True:
                header, payload = await read_frame(reader, LIMITS)
                batch = decode_request(header)
                assert isinstance(batch, PushBatch)
                got.append((batch, payload))
                if await answer(batch, payload, writer) is False:
                    writer.close()
                    return
        except asyncio.IncompleteReadError:
            return

    net.serve("B", SESSION_PROTOCOL, handler)
    stream = await net.transport("A").open_stream("B", (), SESSION_PROTOCOL, 5.0)
    return BatchLink("B", stream, LIMITS, timeout_s=5.0), got


def test_the_steps_of_one_turn_leave_as_one_frame_and_failures_reach_only_their_session():
    heard = Heard()

    async def answer(batch, payload, writer):
        # s2's step failed here; then a later failure of s3's ring is told up the link
        await write_frame(writer, PushBatchAck(seq=batch.seq, failed=[
            ErrorReply(code="bad_request", message="no", session_id="s2", step=1)]))
        await write_frame(writer, ErrorReply(code="internal", message="later", session_id="s3", step=1))

    async def main():
        link, got = await _link(answer)
        for sid in ("s1", "s2", "s3"):
            push, data = _step(sid)
            link.put(push, data, heard.watch(sid))
        await asyncio.sleep(0.05)
        link.close()
        return got

    got = asyncio.run(main())
    assert len(got) == 1 and [i.forward.session_id for i in got[0][0].items] == ["s1", "s2", "s3"]
    assert len(got[0][1]) == 3 * 8  # the three payloads, in item order
    assert set(heard.failed) == {"s2", "s3"} and heard.failed["s3"][0].message == "later"
    assert heard.broken == []  # closing a link with nothing unacked breaks no session


def test_a_link_that_ends_with_steps_unacked_breaks_only_those_sessions():
    heard = Heard()

    async def answer(batch, payload, writer):
        if batch.seq == 0:
            await write_frame(writer, PushBatchAck(seq=0))
            return True
        return False  # the next peer dies with the second batch unanswered

    async def main():
        link, _ = await _link(answer)
        push, data = _step("s1")
        link.put(push, data, heard.watch("s1"))
        await asyncio.sleep(0.05)  # acked
        push, data = _step("s2")
        link.put(push, data, heard.watch("s2"))
        await asyncio.sleep(0.05)
        return link.broken

    assert asyncio.run(main()) is True
    assert heard.broken == ["s2"] and heard.failed == {}


def test_an_ack_naming_a_session_outside_its_batch_is_ignored():
    heard = Heard()

    async def answer(batch, payload, writer):
        await write_frame(writer, PushBatchAck(seq=batch.seq, failed=[
            ErrorReply(code="internal", message="framed", session_id="s9", step=1)]))

    async def main():
        link, _ = await _link(answer)
        push, data = _step("s9")  # s9 is watched, with its step in the first batch
        link.put(push, data, heard.watch("s9"))
        await asyncio.sleep(0.05)
        heard.failed.clear()
        push, data = _step("s1")  # the second batch's ack names s9 again: not one of its items
        link.put(push, data, heard.watch("s1"))
        await asyncio.sleep(0.05)
        link.close()

    asyncio.run(main())
    assert heard.failed == {}


def test_acks_are_matched_by_seq_and_a_refused_batch_fails_only_its_items():
    """The next peer runs a stream's batches side by side, so acks come as batches finish."""
    heard = Heard()
    got: list[PushBatch] = []

    async def answer(batch, payload, writer):
        got.append(batch)
        if len(got) == 3:  # the third batch is refused whole; then the second, then the first is acked
            await write_frame(writer, ErrorReply(code="bad_request", message="no", step=got[2].seq))
            await write_frame(writer, PushBatchAck(seq=got[1].seq))
            await write_frame(writer, PushBatchAck(seq=got[0].seq, failed=[
                ErrorReply(code="internal", message="x", session_id="s1", step=1)]))

    async def main():
        link, _ = await _link(answer)
        for sid in ("s1", "s2", "s3"):
            push, data = _step(sid)
            link.put(push, data, heard.watch(sid))
            await asyncio.sleep(0.02)  # each its own batch
        await asyncio.sleep(0.05)
        broken = link.broken
        link.close()
        return broken

    assert asyncio.run(main()) is False
    assert {sid: [r.code for r in rs] for sid, rs in heard.failed.items()} == {"s1": ["internal"], "s3": ["bad_request"]}
    assert heard.broken == []


def test_frames_are_cut_by_item_count_and_header_size():
    items = [_Item(*_step(f"s{i}", route=[PushHop(peer_id="Qm" + "a" * 44, session_id="x" * 100)]))
             for i in range(10)]
    one = len(msgspec.msgpack.encode(items[0].push))
    runs = frames_of(items, 3 * one)
    assert [len(r) for r in runs] == [3, 3, 3, 1]
    assert [i for r in runs for i in r] == items
    assert frames_of(items, 1) == [[i] for i in items]  # one item always goes, alone
    again = _Item(*_step("s1", step=2))
    assert [len(r) for r in frames_of([items[0], items[1], again], 10**6)] == [2, 1]  # a session once a frame
