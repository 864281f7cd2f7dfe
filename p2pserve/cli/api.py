"""``p2pserve api``: an OpenAI-compatible HTTP server over the swarm (or a fixed set of peers).

    p2pserve api --port 8000 --initial-peers /ip4/.../p2p/Qm... [--model PATH]
    p2pserve api --port 8000 --config bootstrap/swarm.toml --model PATH
    p2pserve api --port 8000 --peers /ip4/127.0.0.1/tcp/4001/p2p/Qm...@0:30

Prints ``P2PSERVE_API_READY url=http://HOST:PORT model=NAME`` once it listens (``--port 0`` picks
a free port). The HTTP flags build one :class:`~p2pserve.config.ApiConfig`. Also defines the
client flags shared with ``p2pserve chat``.
"""

from __future__ import annotations

import argparse
import dataclasses
import asyncio
import logging
import os
import signal

from p2pserve.config import PUSH_MODES, ApiConfig, ClientConfig, SpeculativeConfig

API_KEY_ENV = "P2PSERVE_API_KEY"


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags every client command accepts: where the swarm is, which model, retry limits."""
    from p2pserve.cli.common import add_revision_argument

    g = parser.add_argument_group("swarm")
    g.add_argument("--config", default=None,
                   help="swarm config file (.toml or .json): initial peers, swarm id, trusted coordinators, model name; flags override it")
    g.add_argument("--model", default=None, help="checkpoint for tokenizer and shapes: a folder, or a hub id ORG/NAME "
                                                 "whose configs and tokenizer are fetched (default: embedded SmolLM2)")
    add_revision_argument(g)
    g.add_argument("--initial-peers", nargs="*", default=None, help="DHT multiaddrs of the swarm (routes follow the plan)")
    g.add_argument("--peers", nargs="*", default=None, metavar="MADDR@START:END",
                   help="a fixed set of peers instead of the swarm (MADDR ends with /p2p/<peer id>)")
    g.add_argument("--swarm-model", default=None,
                   help="model name of the swarm's DHT keys (default: the swarm file's 'model', else the checkpoint id)")
    g.add_argument("--quant", default=None, choices=["none", "int8", "nf4", "int4"],
                   help="route only over peers serving the model at this weight-only quantization (docs/quantization.md)")
    g.add_argument("--swarm-id", default=None, help="swarm id prefixing DHT keys (default from the file, else 'p2pserve')")
    g.add_argument("--trusted-coordinator", action="append", default=None, metavar="PUBKEY",
                   help="OpenSSH public key of a coordinator whose plans to follow (repeatable; none = open swarm)")
    r = parser.add_argument_group("requests")
    r.add_argument("--max-length", type=int, default=ClientConfig.max_length, help="context limit (prompt + reply tokens)")
    r.add_argument("--hop-timeout", type=float, default=ClientConfig.hop_timeout_s, help="seconds per hop round trip")
    r.add_argument("--max-retries", type=int, default=ClientConfig.max_retries, help="route rebuilds per step")
    r.add_argument("--seed", type=int, default=None, help="routing seed (default: random per client)")
    r.add_argument("--verify-share", type=float, default=ClientConfig.verify_share,
                   help="share of each hop's steps re-executed on another replica in the background "
                        "(0 = off; docs/trust.md)")
    r.add_argument("--push", default="ring", choices=list(PUSH_MODES),
                   help="how peers drive a route's steps (docs/wan.md). ring (default): every route of two or more "
                        "hops runs as a ring, the last peer feeding each token back to the first itself (a token "
                        "crosses one link per hop; every hop answers the client too, so verified routes ring; "
                        "with --speculative, the steps that verify drafts go peer to peer as a chain, the last "
                        "peer returning the tokens); off: the client drives every hop of every step. Peers find "
                        "each other in the swarm's records: where one cannot reach the next (two --peers with no "
                        "swarm between them), the client drives that route itself and bans neither. Steps that "
                        "carry a grammar's mask are driven whatever the mode. A route of one peer loops on that "
                        "peer whatever the mode (--no-loop)")
    r.add_argument("--no-loop", action="store_true",
                   help="drive a peer that holds every layer token by token from the client, instead of letting "
                        "it sample and run each next step itself (docs/engine.md, 'Peer-driven decode'); "
                        "for comparisons")
    r.add_argument("--verify-hold", action="store_true",
                   help="a non-streamed reply waits for the checks drawn on it, and is regenerated without a "
                        "peer they convict (docs/trust.md, 'Rolling back')")
    r.add_argument("--verify-every-request", action="store_true",
                   help="check every hop of every request in full on another replica, never skipped; with "
                        "--verify-hold, no non-streamed reply returns before its checks passed (docs/trust.md, "
                        "'Every request'; costs about one prefill per hop per request)")
    r.add_argument("--speculative", default=None, metavar="prompt-lookup|draft:PATH",
                   help="speculative decoding (docs/speculative.md): draft tokens by prompt lookup or with a small "
                        "local model sharing the tokenizer, verify several per step. Off by default: it helps "
                        "replies that copy (code edits, summaries) on slow links, and costs compute elsewhere")
    r.add_argument("--speculative-max-k", type=int, default=SpeculativeConfig.max_k,
                   help="most draft tokens per step (k is adaptive; default %(default)s)")
    parser.add_argument("--log-level", default="WARNING")


def apply_swarm_file(args: argparse.Namespace) -> None:
    """Fill the swarm flags a user left out from ``--config``, the file every member of a swarm
    shares (so a client joins with the same file as peers and coordinators); flags given win,
    even empty ones (``swarm_file.merge``)."""
    from p2pserve.cli.common import dht_flags
    from p2pserve.config import DHTConfig
    from p2pserve.model.identity import explicit_name
    from p2pserve.config.swarm_file import SwarmFile, merge

    file = SwarmFile.load(args.config)
    m = merge(file.dht_values(), dht_flags(args))
    args.swarm_id = m.get("swarm_id") or DHTConfig.swarm_id
    args.initial_peers = list(m.get("initial_peers") or ())
    args.trusted_coordinator = list(m.get("trusted_coordinators") or ())
    # --swarm-model, else the file's model; else the client derives the name from its checkpoint
    # when it has loaded it (the one rule of p2pserve/model/identity.py)
    args.swarm_model = explicit_name(args.swarm_model, file.model)


def client_from_args(args: argparse.Namespace):
    """An (unstarted) ``AsyncClient`` from the flags of :func:`add_client_arguments` and ``--config``."""
    from p2pserve.client.api import AsyncClient
    from p2pserve.config import PushConfig
    from p2pserve.errors import ConfigError

    apply_swarm_file(args)
    if not args.peers and not args.initial_peers:
        raise ConfigError("give --initial-peers or --config (a swarm), or --peers (fixed peers)")
    config = ClientConfig(hop_timeout_s=args.hop_timeout, max_retries=args.max_retries, verify_share=args.verify_share,
                          push=dataclasses.replace(PushConfig.from_mode(args.push), loop=not args.no_loop),
                          verify_hold=args.verify_hold,
                          verify_every_request=args.verify_every_request,
                          initial_peers=tuple(args.initial_peers or ()), model=args.model, peers=tuple(args.peers or ()),
                          swarm_model=args.swarm_model, swarm_id=args.swarm_id,
                          trusted_coordinators=tuple(args.trusted_coordinator or ()), seed=args.seed,
                          max_length=args.max_length, speculative=args.speculative, quant=args.quant,
                          speculative_config=SpeculativeConfig(max_k=args.speculative_max_k))
    return AsyncClient(config=config)


async def start_client(args: argparse.Namespace):
    """Build and start the client (it loads the model and joins the swarm or dials the peers)."""
    return await client_from_args(args).start()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``p2pserve api``."""
    d = ApiConfig()
    parser.epilog = ("Status codes: 400 bad input, 401 missing/wrong key, 408 body too slow, 413 body too large, "
                     "429 (Retry-After) every route overloaded or --max-generations running, 503 no route, "
                     "--max-connections open or --max-inflight-body-mb being read.")
    parser.add_argument("--host", default=d.host, help="address to listen on (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=d.port, help="TCP port (0 = pick a free one)")
    parser.add_argument("--served-model-name", action="append", default=[],
                        help="extra model name requests may use (repeatable; the checkpoint id always works)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help=f"require 'Authorization: Bearer KEY' on every /v1 request and /metrics (401 otherwise); default "
                             f"${API_KEY_ENV}, which keeps the key out of the process list. With neither, the API "
                             f"is OPEN to anyone who can connect (logged at start)")
    parser.add_argument("--allowed-host", dest="allowed_hosts", action="append", default=[], metavar="NAME",
                        help="without an API key, requests are answered only for Host IP addresses and localhost "
                             "(a page elsewhere must not reach this API through the browser); add a name (repeatable)")
    parser.add_argument("--dashboard", action="store_true",
                        help="also serve the live swarm dashboard at /dashboard/ and its JSON at /api/swarm, with "
                             "this server's recent routes (docs/dashboard.md); not behind --api-key")
    h = parser.add_argument_group("HTTP limits")
    h.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                   help="seconds from connecting (or the last response) to a complete request head; then closed (default %(default)s)")
    h.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                   help="seconds for the request body once the head is in (408, then closed; default %(default)s)")
    h.add_argument("--keep-alive", type=float, default=d.keep_alive_s, help="seconds an idle connection is kept (default %(default)s)")
    h.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / 2**20,
                   help="largest request body in MiB (413; default %(default)s)")
    h.add_argument("--max-inflight-body-mb", type=float, default=d.max_inflight_body_bytes / 2**20,
                   help="request bodies being read, all together, in MiB; past it 503 (default %(default)s)")
    h.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections; the next one gets 503 and is closed (default %(default)s)")
    h.add_argument("--max-generations", type=int, default=d.max_generations,
                   help="generations in flight; the next request gets 429 with Retry-After (default %(default)s)")
    h.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                   help="longest prompt in characters (or token ids), refused with 400 before tokenising (default %(default)s)")
    add_client_arguments(parser)


def api_config_from_args(args: argparse.Namespace) -> ApiConfig:
    """The server's ApiConfig from the flags (the key from ``--api-key``, else the environment)."""
    return ApiConfig(
        host=args.host, port=args.port, served_model_names=tuple(args.served_model_name),
        api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None,
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout, keep_alive_s=args.keep_alive,
        max_body_bytes=int(args.max_body_mb * 2**20), max_inflight_body_bytes=int(args.max_inflight_body_mb * 2**20),
        max_connections=args.max_connections,
        max_generations=args.max_generations, max_prompt_chars=args.max_prompt_chars,
        allowed_hosts=tuple(args.allowed_hosts),
    )


def run(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C / SIGTERM."""
    from p2pserve.http.openai.server import OpenAIServer
    from p2pserve.errors import P2PServeError

    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING))

    async def main() -> int:
        config = api_config_from_args(args)  # bad limits fail here, before the swarm is joined
        client = await start_client(args)
        served, watch, refresher = client, None, None
        if args.dashboard:
            from p2pserve.dashboard.app import mount_dashboard
            from p2pserve.dashboard.watch import client_dashboard

            served, watch = client_dashboard(client)
        server = OpenAIServer(served, config)
        if watch is not None:
            mount_dashboard(server.app, watch)
            await watch.refresh()
            refresher = asyncio.create_task(watch.run())
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            port = await server.start()
            print(f"P2PSERVE_API_READY url=http://{config.host}:{port} model={server.primary_model}", flush=True)
            if watch is not None:
                print(f"P2PSERVE_DASHBOARD_READY url=http://{config.host}:{port}/dashboard/", flush=True)
            await stop.wait()
        finally:
            if refresher is not None:
                refresher.cancel()
            await server.close()
            await client.close()
        return 0

    try:
        return asyncio.run(main())
    except P2PServeError as e:
        print(f"error: {e}")
        return 1
