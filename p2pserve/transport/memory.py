"""An in-process transport for unit tests: streams are pairs of in-memory pipes.

Every :class:`MemoryTransport` joins one :class:`MemoryNetwork`, which maps peer ids to the
protocols they serve. Opening a stream starts the callee's handler as a task on the same event
loop, with a reader and writer wired back to back to the caller's. No daemon, no sockets: the
client code under test runs exactly as over libp2p, down to the frame codec.

:meth:`MemoryNetwork.disconnect` cuts every stream of a peer (both sides read EOF), which is how
a test kills a peer mid-generation.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

from p2pserve.transport import Stream, StreamHandler
from p2pserve.types import PeerId


class PipeWriter:
    """The writing end of one direction of an in-memory stream (an ``asyncio.StreamWriter`` look-alike)."""

    def __init__(self, sink: asyncio.StreamReader):
        self._sink = sink
        self.closed = False

    def write(self, data) -> None:
        """Deliver ``data`` to the other side's reader."""
        if self.closed:
            raise ConnectionResetError("stream closed")
        self._sink.feed_data(bytes(data))

    async def drain(self) -> None:
        """Yield to the loop once, as a real write would (the pipe itself never fills)."""
        if self.closed:
            raise ConnectionResetError("stream closed")
        await asyncio.sleep(0)

    def close(self) -> None:
        """End the stream: the other side reads EOF."""
        if not self.closed:
            self.closed = True
            self._sink.feed_eof()

    def is_closing(self) -> bool:
        """Whether :meth:`close` was called."""
        return self.closed

    async def wait_closed(self) -> None:
        """Nothing to wait for in memory."""

    def get_extra_info(self, name: str, default=None):
        """No socket behind a pipe."""
        return default


class MemoryNetwork:
    """The in-process 'internet' that :class:`MemoryTransport` nodes share."""

    def __init__(self):
        self.handlers: dict[str, dict[str, StreamHandler]] = {}
        self._pipes: dict[str, list[tuple[PipeWriter, PipeWriter]]] = {}
        self._tasks: set[asyncio.Task] = set()

    def transport(self, peer_id: PeerId) -> "MemoryTransport":
        """A node with id ``peer_id`` on this network."""
        return MemoryTransport(self, peer_id)

    def serve(self, peer_id: PeerId, protocol: str, handler: StreamHandler) -> None:
        """Make ``peer_id`` answer streams of ``protocol`` with ``handler``."""
        self.handlers.setdefault(peer_id, {})[protocol] = handler

    def connect(self, caller: str, callee: str, protocol: str) -> Stream:
        """Open a stream from ``caller`` to ``callee``'s ``protocol`` handler."""
        handler = self.handlers.get(callee, {}).get(protocol)
        if handler is None:
            raise ConnectionRefusedError(f"{callee} does not serve {protocol}")
        to_callee, to_caller = asyncio.StreamReader(), asyncio.StreamReader()
        caller_w, callee_w = PipeWriter(to_callee), PipeWriter(to_caller)
        for peer in (caller, callee):
            self._pipes.setdefault(peer, []).append((caller_w, callee_w))
        task = asyncio.get_running_loop().create_task(handler(to_callee, callee_w, caller))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return Stream(to_caller, caller_w, "memory")

    def disconnect(self, peer_id: PeerId) -> None:
        """Cut every stream ``peer_id`` takes part in and forget what it serves (it 'died')."""
        self.handlers.pop(peer_id, None)
        for a, b in self._pipes.pop(peer_id, []):
            a.close()
            b.close()


class MemoryTransport:
    """A :class:`~p2pserve.transport.Transport` on a :class:`MemoryNetwork`."""

    def __init__(self, network: MemoryNetwork, peer_id: PeerId):
        self.network = network
        self._peer_id = peer_id

    @property
    def peer_id(self) -> str:
        """This node's id on the network."""
        return self._peer_id

    async def open_stream(self, peer_id: PeerId, maddrs: Sequence[str], protocol: str, timeout_s: float) -> Stream:
        """A stream to ``peer_id``'s handler (addresses are not needed in memory)."""
        return self.network.connect(self._peer_id, peer_id, protocol)

    async def serve(self, protocol: str, handler: StreamHandler) -> None:
        """Answer inbound streams of ``protocol`` with ``handler``."""
        self.network.serve(self._peer_id, protocol, handler)

    async def stop_serving(self, protocol: str) -> None:
        """Stop answering ``protocol``."""
        self.network.handlers.get(self._peer_id, {}).pop(protocol, None)

    async def close(self) -> None:
        """Leave the network: every stream of this node ends."""
        self.network.disconnect(self._peer_id)
