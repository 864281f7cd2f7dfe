"""``p2pserve chat``: an interactive terminal chat through the swarm.

Each answer streams as it is generated, then a dim line shows the route it took (every route,
if a peer failed and the client re-routed), time to first token and tokens/s. Commands:
``/reset`` forgets the conversation, ``/quit`` (or Ctrl-D) leaves.

    p2pserve chat --initial-peers /ip4/.../p2p/Qm...
    p2pserve chat --peers /ip4/127.0.0.1/tcp/4001/p2p/Qm...@0:30 --temperature 0.7
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from p2pserve.cli.api import add_client_arguments, start_client
from p2pserve.errors import P2PServeError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``p2pserve chat``."""
    add_client_arguments(parser)
    g = parser.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--system", default=None, help="system prompt")
    g.add_argument("--prompt", action="append", default=None,
                   help="answer this message and exit instead of reading stdin (repeatable: several turns)")


def route_line(reply) -> str:
    """The status line shown after an answer."""
    ttft = f"{reply.first_token_s * 1000:.0f} ms to first token, " if reply.first_token_s is not None else ""
    extra = f", {len(reply.failures)} failover(s)" if reply.failures else ""
    return (f"[route {reply.route_text()} | {len(reply.tokens)} tokens, {ttft}"
            f"{reply.tokens_per_s:.1f} tokens/s{extra}]")


async def chat_loop(client, args, read_line, write) -> None:
    """The REPL: read a line, stream the answer, print the route. ``read_line`` returns None at EOF."""
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        line = await read_line()
        if line is None or line.strip() in ("/quit", "/exit"):
            return
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            history = history[:1] if args.system else []
            write("(conversation cleared)\n")
            continue
        history.append({"role": "user", "content": text})
        try:
            stream = client.chat_stream(history, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                        top_p=args.top_p, top_k=args.top_k)
            async for piece in stream:
                write(piece)
        except P2PServeError as e:  # one failed answer does not end the conversation
            history.pop()
            write(f"\n[error: {e}]\n")
            continue
        reply = stream.reply
        history.append({"role": "assistant", "content": reply.text})
        write("\n" + route_line(reply) + "\n")


def run(args: argparse.Namespace) -> int:
    """Start the client and chat until EOF."""
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING))
    interactive = args.prompt is None and sys.stdin.isatty()

    def write(s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()

    async def main() -> None:
        write("connecting...\n")
        client = await start_client(args)
        try:
            write(f"model {client.model_id}; type /reset to start over, /quit to leave\n" if interactive else "")
            if args.prompt is not None:
                queue = list(args.prompt)

                async def read_line():
                    if not queue:
                        return None
                    line = queue.pop(0)
                    write(f"> {line}\n")
                    return line
            else:
                async def read_line():
                    if interactive:
                        write("> ")
                    line = await asyncio.to_thread(sys.stdin.readline)
                    return line if line else None

            await chat_loop(client, args, read_line, write)
        finally:
            await client.close()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        write("\n")
        return 130
    except P2PServeError as e:
        write(f"\nerror: {e}\n")
        return 1
    return 0
