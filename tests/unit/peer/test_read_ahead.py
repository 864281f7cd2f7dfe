"""A stream read on while one of its requests waits (``peer/read_ahead.py``)."""

from __future__ import annotations

import asyncio

from p2pserve.peer.read_ahead import ReadAhead
from p2pserve.protocol import FRAME_PREFIX, FrameLimits

LIMITS = FrameLimits(max_header_bytes=100, max_payload_bytes=1000)


def _frame(header: bytes, payload: bytes = b"") -> bytes:
    return FRAME_PREFIX.pack(len(header), len(payload)) + header + payload


def test_frames_behind_a_wait_are_kept_in_order_and_the_wait_answers():
    async def main():
        reader = asyncio.StreamReader()
        ahead = ReadAhead(reader, LIMITS)
        reader.feed_data(_frame(b"one") + _frame(b"two"))
        got = await ahead.race(asyncio.sleep(0.05, result="answer"))
        return got, ahead.take(), ahead.take(), ahead.take(), ahead.hung_up

    got, first, second, rest, hung_up = asyncio.run(main())
    assert got == "answer" and not hung_up
    assert first == (FRAME_PREFIX.pack(3, 0), b"one") and second == (FRAME_PREFIX.pack(3, 0), b"two")
    assert rest == (None, None)


def test_a_hang_up_ends_the_wait_and_cancels_it():
    async def main():
        reader = asyncio.StreamReader()
        ahead = ReadAhead(reader, LIMITS)
        wait = asyncio.get_running_loop().create_future()
        reader.feed_data(_frame(b"close"))
        asyncio.get_running_loop().call_later(0.05, reader.feed_eof)
        got = await ahead.race(wait)
        return got, wait.cancelled(), ahead.hung_up

    assert asyncio.run(main()) == (None, True, True)


def test_a_frame_with_a_payload_or_a_refused_prefix_stops_the_reading_and_is_left_whole():
    async def main(data: bytes):
        reader = asyncio.StreamReader()
        ahead = ReadAhead(reader, LIMITS)
        reader.feed_data(data)
        reader.feed_eof()  # after the frame: not seen, since the reading stopped before it
        got = await ahead.race(asyncio.sleep(0.05, result="answer"))
        prefix, header = ahead.take()
        return got, prefix, header, await reader.read(), ahead.hung_up

    got, prefix, header, rest, hung_up = asyncio.run(main(_frame(b"fwd", b"xyz")))
    assert (got, prefix, header, rest, hung_up) == ("answer", FRAME_PREFIX.pack(3, 3), None, b"fwdxyz", False)
    too_big = FRAME_PREFIX.pack(10_000, 0)
    assert asyncio.run(main(too_big + b"h"))[1:] == (too_big, None, b"h", False)


def test_at_most_max_frames_are_held():
    async def main():
        reader = asyncio.StreamReader()
        ahead = ReadAhead(reader, LIMITS, max_frames=2)
        reader.feed_data(_frame(b"a") * 5)
        await ahead.race(asyncio.sleep(0.05))
        return len(ahead.frames), len(await reader.read(3 * len(_frame(b"a"))))

    assert asyncio.run(main()) == (2, 3 * len(_frame(b"a")))
