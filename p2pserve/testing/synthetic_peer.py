"""A synthetic peer for control-plane tests: real DHT node, real signed records, real link
probes, no model.

It stands in for the peer runtime in control-plane tests and demos: it announces a PeerInfo
shaped like a small GPU peer, probes links over ``p2pserve.probe`` and follows the plan
(joining -> loading the target range for ``--load-delay`` seconds -> serving it).

    python -m p2pserve.testing.synthetic_peer --initial-peers ... --model M --max-layers 4

``--absurd`` announces 10^12 tokens/s (bypassing local validation) so that tests can check
that readers drop such records with a logged reason.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Optional

from p2pserve.cli.common import add_dht_arguments, dht_config_from_args, setup_logging
from p2pserve.clock import monotonic, wall
from p2pserve.config import ProberConfig
from p2pserve.dht.announcer import Announcer
from p2pserve.dht.evidence import reply_key_text
from p2pserve.dht.receipts import sign_receipt
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.prober import LinkProber
from p2pserve.dht.probe_rounds import ProbeRounds
from p2pserve.dht.records import PeerInfo, encode_record
from p2pserve.dht.swarm import Swarm
from p2pserve.types import LayerRange, PeerId

logger = logging.getLogger("p2pserve.testing.synthetic_peer")


class SyntheticState:
    """Mutable self-description of the synthetic peer (what it would announce)."""

    def __init__(self, model: str, peer_id: PeerId, addrs: list[str], args: argparse.Namespace, reply_key=None):
        self.model, self.peer_id, self.addrs, self.args = model, peer_id, addrs, args
        self.reply_key = reply_key  # its Ed25519 reply key: it signs service receipts with it
        self.state = "joining"
        self.serving: Optional[LayerRange] = None
        self.loading: Optional[LayerRange] = None
        self.flip_at: Optional[float] = None  # when the range being "loaded" is ready

    def peer_info(self) -> PeerInfo:
        """The PeerInfo for the current state. T[j] = tps / j (one device, j layers in sequence)."""
        k = self.args.max_layers
        scale = 1e12 if self.args.absurd else self.args.tps
        return PeerInfo(
            model=self.model,
            peer_id=self.peer_id,
            addrs=self.addrs,
            device=self.args.device,
            weights_memory_bytes=k * 200 << 20,
            kv_memory_bytes=1 << 30,
            dtype="float16",
            throughput_decode=[scale / j for j in range(1, k + 1)],
            throughput_prefill=[8 * scale / j for j in range(1, k + 1)],
            max_layers=k,
            serving=self.serving,
            loading=self.loading,
            state=self.state,
            kv_free_tokens=100_000,
            queued_tokens=0,
            version="synthetic",
            timestamp=wall(),
            reply_key=reply_key_text(self.reply_key) if self.reply_key is not None else "",
        )

    def write_receipts(self, folder: Path) -> None:
        """Sign a service receipt for every client that asks in ``folder`` (a file
        ``client-<peer id>``), as a real peer does when it opens a session for that client: it
        writes ``receipt-<its peer id>-<client id>`` (the receipt, hex)."""
        for ask in folder.glob("client-*"):
            client = ask.name.removeprefix("client-")
            out = folder / f"receipt-{self.peer_id}-{client}"
            if self.reply_key is not None and not out.exists():
                out.write_text(sign_receipt(self.reply_key, self.peer_id, client).hex())

    def follow(self, target: Optional[LayerRange], now: float) -> bool:
        """Start "loading" a new target and flip once it is loaded; returns whether the state changed."""
        changed = False
        if target is not None and target != self.serving and target != self.loading:
            self.loading, self.state, self.flip_at = target, "loading", now + self.args.load_delay
            logger.info(f"loading {target}")
            changed = True
        if self.flip_at is not None and now >= self.flip_at:
            self.serving, self.loading, self.state, self.flip_at = self.loading, None, "serving", None
            logger.info(f"serving {self.serving}")
            changed = True
        return changed


class UncheckedSwarm(Swarm):
    """A Swarm that skips local validation of its PeerInfo (``--absurd`` only): what a buggy
    or hostile peer would publish."""

    async def announce_peer(self, info: PeerInfo) -> bool:
        """Store ``info`` as is."""
        return await self._put(RecordKind.PEERS, encode_record(info), self.config.peer_ttl)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the synthetic peer."""
    add_dht_arguments(parser)
    parser.add_argument("--max-layers", type=int, default=4)
    parser.add_argument("--tps", type=float, default=400.0, help="decode tokens/s holding one layer")
    parser.add_argument("--device", default="synthetic-gpu")
    parser.add_argument("--load-delay", type=float, default=0.5, help="seconds 'loading' a range takes")
    parser.add_argument("--no-probe", action="store_true")
    parser.add_argument("--absurd", action="store_true", help="announce 10^12 tokens/s")
    parser.add_argument("--receipts", default=None, metavar="DIR",
                        help="sign a service receipt for each client-<peer id> file in DIR (a served client)")


async def amain(args: argparse.Namespace) -> int:
    """Run until SIGTERM/SIGINT; withdraws its records on the way out."""
    dcfg, _ = dht_config_from_args(args)
    swarm = (UncheckedSwarm if args.absurd else Swarm).create(dcfg)
    try:
        st = SyntheticState(dcfg.model, swarm.peer_id, swarm.visible_maddrs(), args, swarm.reply_key())
        prober = None
        if not args.no_probe:
            prober = LinkProber(await swarm.replicate_p2p(),
                                ProberConfig(min_interval_s=dcfg.link_refresh, max_probe_bytes=16 << 20))
            await prober.start()
        rounds = ProbeRounds(swarm, prober) if prober else None
        announcer = Announcer(swarm, st.peer_info, (lambda: prober.link_info(dcfg.model, st.peer_id)) if prober else None)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(f"peer {st.peer_id}", flush=True)
        ann_task = asyncio.create_task(announcer.run(stop))
        last_probe = 0.0
        while not stop.is_set():
            try:
                signed = await swarm.get_plan()
                if st.follow(signed.plan.targets.get(st.peer_id) if signed else None, monotonic()):
                    announcer.poke()
                if args.receipts:
                    st.write_receipts(Path(args.receipts))
                if rounds and monotonic() - last_probe >= min(dcfg.link_refresh, 2.0):
                    last_probe = monotonic()
                    if await rounds.step():
                        announcer.poke_links()
            except (asyncio.TimeoutError, OSError) as e:
                logger.warning(f"synthetic peer round failed: {e!r}")
            try:
                await asyncio.wait_for(stop.wait(), min(dcfg.peer_refresh, 0.5))
            except asyncio.TimeoutError:
                pass
        await ann_task
    finally:
        swarm.shutdown()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m p2pserve.testing.synthetic_peer``."""
    parser = argparse.ArgumentParser(prog="python -m p2pserve.testing.synthetic_peer", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())

