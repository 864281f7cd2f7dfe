"""`p2pserve demo`: start a local swarm of peer processes and answer a chat prompt through it.

Every process started here is in its own process group and is killed on exit, on errors and
on Ctrl-C, so an interrupted demo leaves nothing running.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the demo's flags."""
    p.add_argument("--model", default="default", help="checkpoint directory, or 'default' (embedded SmolLM2-135M-Instruct)")
    p.add_argument("--peers", type=int, default=3, help="number of peer processes (the layers are split evenly)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message to answer")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--threads", type=int, default=1, help="torch threads per peer")


def split_layers(num_layers: int, parts: int) -> list[tuple[int, int]]:
    """Split [0, num_layers) into ``parts`` contiguous, nearly equal ranges."""
    parts = max(1, min(parts, num_layers))
    bounds = [round(i * num_layers / parts) for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


async def _chat(peers, model, args) -> None:
    from p2pserve.client.chain import ChainChat, create_client_p2p, open_chain_session
    from p2pserve.client.generation import GenerationParams

    params = GenerationParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    hops = [p.hop() for p in peers]
    p2p = await create_client_p2p()
    try:
        session = await open_chain_session(p2p, hops, model, 2048, params)
        chat = ChainChat(session, model)
        print("route: client -> " + " -> ".join(f"peer {h.peer_id[-6:]} layers [{h.start}, {h.end})" for h in hops) + " -> client")
        print(f"\nuser: {args.prompt}\nassistant: ", end="", flush=True)
        t = time.perf_counter()
        async for event in chat.stream(args.prompt, params):
            print(event.text, end="", flush=True)
        dt = time.perf_counter() - t
        n = len(chat.last_result.tokens)
        print(f"\n\n[{n} tokens in {dt:.1f} s, {n / dt:.1f} tokens/s, through {len(hops)} peer processes]")
        await session.close()
    finally:
        await p2p.shutdown()


def run(args: argparse.Namespace) -> int:
    """Entry point of `p2pserve demo`."""
    from p2pserve.client.chain import LocalModelInfo
    from p2pserve.errors import P2PServeError
    from p2pserve.launch import PeerProcess

    peers: list[PeerProcess] = []
    try:
        print("[1/3] preparing the model (the first run converts the embedded SmolLM2 GGUF, ~30 s)...", flush=True)
        model = LocalModelInfo.load(args.model)
        ranges = split_layers(model.spec.num_layers, args.peers)
        print(f"[2/3] starting {len(ranges)} peer processes: " + ", ".join(f"[{a}, {b})" for a, b in ranges), flush=True)
        peers = [PeerProcess.launch(model.path, r, threads=args.threads) for r in ranges]
        for i, peer in enumerate(peers):
            peer.wait_ready()
            print(f"      peer {i + 1} ready: {peer.peer_id} serving layers {peer.layers}", flush=True)
        print("[3/3] chatting through the swarm", flush=True)
        asyncio.run(_chat(peers, model, args))
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; stopping peers", file=sys.stderr)
        return 130
    except P2PServeError as e:
        print(f"p2pserve demo: error: {e}", file=sys.stderr)
        return 2
    finally:
        for peer in peers:
            peer.stop()
