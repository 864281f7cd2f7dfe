"""`p2pserve peer`: serve layers of a model over hivemind's libp2p transport.

With ``--layers START:END`` the peer serves that fixed range (the mode tests and the inference
path use). It prints one machine-readable line once it serves::

    P2PSERVE_PEER_READY peer_id=<id> layers=<start>:<end> maddrs=<maddr>[,<maddr>...]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from p2pserve.config import BatchingConfig, PeerConfig
from p2pserve.errors import ConfigError, P2PServeError
from p2pserve.protocol import FrameLimits


def parse_layers(text: str) -> tuple[int, int]:
    """Parse 'START:END' (half-open) into a tuple."""
    try:
        a, b = text.split(":")
        return int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers takes START:END, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the peer's flags."""
    d = PeerConfig()
    b = BatchingConfig()
    p.add_argument("--model", default="default", help="checkpoint directory, or 'default' (embedded SmolLM2-135M-Instruct)")
    p.add_argument("--layers", type=parse_layers, default=None, metavar="START:END",
                   help="serve this fixed half-open layer range (default: all layers)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="compute device (default: cuda if --gpu given, else cpu)")
    p.add_argument("--gpu", type=int, default=None, metavar="N", help="CUDA device index; implies --device cuda")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR", help="multiaddrs of DHT nodes to join")
    p.add_argument("--host-maddrs", nargs="*", default=list(d.host_maddrs), metavar="MADDR", help="addresses to listen on")
    p.add_argument("--announce-maddrs", nargs="*", default=[], metavar="MADDR", help="public addresses to announce (behind NAT)")
    p.add_argument("--identity-path", default=None, help="private key file; makes the peer id stable across restarts")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--kv-memory-gb", type=float, default=d.kv_memory_bytes / 1024**3, help="memory for the KV cache")
    p.add_argument("--kv-token-layers", type=int, default=None, help="KV budget in token-layer slots (overrides --kv-memory-gb)")
    p.add_argument("--session-idle-timeout", type=float, default=d.session_idle_timeout_s, help="seconds before an idle session is freed")
    p.add_argument("--max-payload-mb", type=float, default=d.frame_limits.max_payload_bytes / 1024**2, help="largest accepted frame payload")
    p.add_argument("--max-batch-tokens", type=int, default=b.max_batch_tokens, help="hard cap on tokens per compute step")
    p.add_argument("--pipeline-depth", type=int, default=b.pipeline_depth, help="gLLM decode spreading depth")
    p.add_argument("--log-level", default="INFO")


def config_from_args(args: argparse.Namespace) -> PeerConfig:
    """Build a PeerConfig from parsed flags."""
    device = args.device or ("cuda" if args.gpu is not None else "cpu")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda / --gpu was given but no CUDA device is available")
        device = f"cuda:{args.gpu or 0}"
    start, end = args.layers if args.layers else (None, None)
    return PeerConfig(
        model=args.model,
        start=start,
        end=end,
        device=device,
        dtype=args.dtype,
        num_threads=args.num_threads,
        kv_budget_token_layers=args.kv_token_layers,
        kv_memory_bytes=int(args.kv_memory_gb * 1024**3),
        session_idle_timeout_s=args.session_idle_timeout,
        frame_limits=FrameLimits(max_payload_bytes=int(args.max_payload_mb * 1024**2)),
        batching=BatchingConfig(max_batch_tokens=args.max_batch_tokens, pipeline_depth=args.pipeline_depth),
        initial_peers=tuple(args.initial_peers),
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        identity_path=args.identity_path,
    )


async def serve(config: PeerConfig) -> None:
    """Create a peer, print its ready line, serve until SIGINT/SIGTERM."""
    from p2pserve.peer.server import Peer

    peer = await Peer.create(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(
        f"P2PSERVE_PEER_READY peer_id={peer.peer_id} layers={peer.start}:{peer.end} "
        f"maddrs={','.join(peer.visible_maddrs())}",
        flush=True,
    )
    await stop.wait()
    await peer.shutdown()


def run(args: argparse.Namespace) -> int:
    """Entry point of `p2pserve peer`."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        asyncio.run(serve(config))
    except P2PServeError as e:
        print(f"p2pserve peer: error: {e}", file=sys.stderr)
        return 2
    return 0
