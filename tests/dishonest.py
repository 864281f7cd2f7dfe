"""A dishonest peer for tests: the real peer, whose handler corrupts a share of its steps' outputs,
and which may announce more throughput than it has.

Run as a real peer process: ``python -m tests.dishonest --corrupt-share 0.1 [--seed N]
[--claim-factor F] peer ARGS`` (``ARGS`` as for ``p2pserve peer``). ``--claim-factor F`` multiplies
the throughput tables it measured by ``F`` before it announces them (a liar about its speed). Corrupted hidden states get Gaussian noise as large as the
values themselves (a relative error near 1, far beyond any tolerance); a corrupted token is
another token (in a speculative step, one of its tokens). The peer signs what it sends, corrupted or not: an unsigned or badly signed reply
would be caught without any re-execution.
"""

from __future__ import annotations

import random
import sys

import torch


def corrupt_handler(share: float, seed: int = 0, only_extras: bool = False, looped_only: bool = False) -> None:
    """Patch ``SessionHandler._reply`` so that a ``share`` of steps returns corrupted outputs (with
    ``only_extras``, only of last-hop steps sent a token history: penalties, a grammar...; with
    ``looped_only``, only in sessions that loop on this peer: the peer-driven path, which such a
    peer may believe nobody checks)."""
    from dataclasses import replace

    from p2pserve.peer.handlers import SessionHandler
    from p2pserve.peer.sampling import Choice

    rng = random.Random(seed)
    honest = SessionHandler._reply
    honest_forward = SessionHandler._forward
    looped: set = set()  # ids of the sessions seen looping

    async def forward(self, msg, payload, stream, loops=False):
        if loops:
            looped.add(msg.session_id)
        return await honest_forward(self, msg, payload, stream, loops=loops)

    def reply(self, session, msg, n, commitment, result):
        if (only_extras and msg.context is None) or (looped_only and session.id not in looped):
            return honest(self, session, msg, n, commitment, result)
        if rng.random() < share:
            if isinstance(result, Choice):  # the last token another one (its log-probabilities kept)
                result = replace(result, tokens=result.tokens[:-1] + [(result.tokens[-1] + 1) % self.spec.vocab_size])
            elif isinstance(result, int):
                result = (result + 1) % self.spec.vocab_size
            elif isinstance(result, list):  # a speculative step's tokens: one of them changed
                i = rng.randrange(len(result))
                result = result[:i] + [(result[i] + 1) % self.spec.vocab_size] + result[i + 1:]
            else:
                gen = torch.Generator().manual_seed(rng.getrandbits(31))
                noise = torch.randn(result.shape, generator=gen).to(result.dtype)
                result = result + noise * result.float().std().to(result.dtype)
        return honest(self, session, msg, n, commitment, result)

    SessionHandler._reply = reply
    SessionHandler._forward = forward


def inflate_claims(factor: float) -> None:
    """Patch ``SwarmAgent`` so that the peer announces ``factor`` x the throughput it measured."""
    from dataclasses import replace

    from p2pserve.peer.agent import SwarmAgent

    honest = SwarmAgent.__init__

    def init(self, peer, swarm, profile, *args, **kwargs):
        profile = replace(profile, decode=[min(t * factor, 1e8) for t in profile.decode],
                          prefill=[min(t * factor, 1e8) for t in profile.prefill])
        honest(self, peer, swarm, profile, *args, **kwargs)

    SwarmAgent.__init__ = init


def launch(model: str, layers: tuple[int, int] | None, share: float, *extra: str, seed: int = 0,
           log_path=None, claim_factor: float = 1.0, only_extras: bool = False, looped_only: bool = False,
           env: dict[str, str] | None = None):
    """Start a dishonest peer process on loopback, as ``PeerProcess.launch`` starts an honest one
    (do not wait for it; ``wait_ready()`` works on it). With ``log_path`` its output goes there;
    ``env`` adds to its environment."""
    import os
    import subprocess
    import threading
    from pathlib import Path

    from p2pserve.launch import PeerProcess

    repo = str(Path(__file__).resolve().parents[1])
    args = ["peer", "--model", model, "--num-threads", "1", "--log-level", "WARNING",
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    if layers is not None:
        args += ["--layers", f"{layers[0]}:{layers[1]}"]
    cmd = [sys.executable, "-m", "tests.dishonest", "--corrupt-share", str(share), "--seed", str(seed),
           "--claim-factor", str(claim_factor), "--only-extras", str(int(only_extras)),
           "--looped-only", str(int(looped_only)), *args, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    child = PeerProcess("dishonest", proc)
    threading.Thread(target=child._pump, daemon=True).start()
    return child


def main(argv: list[str]) -> int:
    """Parse ``--corrupt-share X [--seed N] [--claim-factor F]``, patch, then run ``p2pserve`` with the rest."""
    share, seed, factor, only_extras, looped_only = 0.1, 0, 1.0, False, False
    while argv and argv[0].startswith("--"):
        flag, value, argv = argv[0], argv[1], argv[2:]
        if flag == "--corrupt-share":
            share = float(value)
        elif flag == "--seed":
            seed = int(value)
        elif flag == "--claim-factor":
            factor = float(value)
        elif flag == "--only-extras":
            only_extras = bool(int(value))
        elif flag == "--looped-only":
            looped_only = bool(int(value))
        else:
            raise SystemExit(f"unknown flag {flag}")
    if share > 0:
        corrupt_handler(share, seed, only_extras, looped_only)
    if factor != 1.0:
        inflate_claims(factor)
    from p2pserve.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
