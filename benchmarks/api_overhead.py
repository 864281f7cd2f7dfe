"""API overhead benchmark: CPU the ``p2pserve api`` process spends per streamed token.

The API process shares its cores with a peer, so every microsecond it spends per token per
stream is taken from the engine. This measures that cost alone: the real OpenAI server
(uvicorn, the app, the choice streams), the real ``ReplyStream`` / ``Generation`` / detokenizer
with the embedded model's tokenizer, over a stand-in pipeline that answers every step at once
(``p2pserve/testing/instant.py``). ``--streams`` concurrent streamed chat completions of
``--tokens`` tokens each are read by a load generator in this process; the server runs in a
child process, and its CPU time (user + system, all threads) over the load, divided by the
tokens streamed, is the figure.

The baseline is measured in the same run: the same stand-in drives the client and server code
of an earlier commit (``--before``, extracted with ``git archive``), in a second child process,
alternating rounds with the working tree's. Each row gives both, and their ratio (after /
before: lower is better), for tokens arriving one per loop tick per stream (``per_tick`` 1,
the step-by-step path) and several at once (``per_tick`` 4: a ring or speculative step that
delivers a few tokens together). Every stream's text is checked against the tokenizer's decode
of the tokens sent, so a faster path must also be a correct one.

Usage::

    python benchmarks/api_overhead.py [--streams 32] [--tokens 256] [--rounds 3] [--per-tick 1,4]
                                      [--before fd305e7 | --before none] [--json out.json]

Figures on a shared machine are noisy; the ratio, measured with both trees alternating, is
steadier than either figure.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "p2pserve" / "testing" / "instant.py"
#: the commit before the per-token path was made incremental and coalescing
DEFAULT_BEFORE = "fd305e7"
PROMPT = [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}]
# What every reply says: plain prose with some multi-byte characters (held back until complete).
SCRIPT_TEXT = (
    "The keeper climbed the stairs at dusk, as he had every evening for thirty-one years. "
    "Below him the sea rolled grey and slow; above, the lamp waited, its brass warm from the "
    "afternoon sun. He trimmed the wick, wiped the lens — a habit more than a need — and lit it. "
    "Ships he would never meet turned by its light: a trawler from Saint-Malo, a ferry bound for "
    "Åland, a yacht named «Café Noir». He wrote each one in the log, 灯台守 in his neat hand, "
    "then sat with tea until the stars came out. 🌊 Nobody thanked him, and nobody needed to."
)


# ----------------------------------------------------------------------------- the server (child process)


def serve(per_ticks: list[int]) -> None:
    """Run one OpenAI server per ``per_tick`` over the stand-in (with whichever ``p2pserve`` is on
    the path) until stdin closes; prints ``READY <model id> <port>...`` once listening."""
    spec = importlib.util.spec_from_file_location("instant_standin", STANDIN)
    standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)

    from p2pserve.client.model_info import LocalModelInfo
    from p2pserve.config import ApiConfig
    from p2pserve.http.openai.server import OpenAIServer

    info = LocalModelInfo.load(None)
    limits = ApiConfig(port=0, max_generations=1024, max_connections=1024)
    servers = [OpenAIServer(standin.InstantClient(info, script_tokens(info), k), limits) for k in per_ticks]

    async def main() -> None:
        ports = [await server.start() for server in servers]
        print("READY", info.spec.model_id, *ports, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
        for server in servers:
            await server.close()

    asyncio.run(main())


def script_tokens(info) -> list[int]:
    """The token ids every reply cycles through (no end-of-reply id among them)."""
    ids = info.tokenizer(SCRIPT_TEXT, add_special_tokens=False)["input_ids"]
    return [t for t in ids if t not in info.eos_ids]


class Server:
    """A child process serving the stand-in with the ``p2pserve`` package found under ``root``:
    one port per ``per_tick`` (only one is loaded at a time, so the process's CPU is that port's)."""

    def __init__(self, name: str, root: Path, per_ticks: list[int], logdir: Path):
        self.name = name
        env = dict(os.environ, PYTHONPATH=str(root), TOKENIZERS_PARALLELISM="false")
        log = logdir / f"{name}.log"
        self._log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", ",".join(map(str, per_ticks))], env=env,
                                     cwd=str(root), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True)
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "READY":
            self.close()
            raise RuntimeError(f"the {name} server did not start: {log.read_text()}")
        self.model = line[1]
        self.ports = dict(zip(per_ticks, map(int, line[2:])))

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process so far (every thread)."""
        import psutil

        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def close(self) -> None:
        """Stop the process (closing stdin lets it shut down cleanly)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=20)
        except (subprocess.TimeoutExpired, OSError):
            self.proc.kill()
        self._log.close()


def checkout(ref: str, into: Path) -> Optional[Path]:
    """``p2pserve/`` of commit ``ref`` extracted under ``into`` (None when git cannot give it)."""
    archive = into / "before.tar"
    try:
        subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), ref, "p2pserve"], check=True,
                       capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"no baseline: git archive {ref} failed: {getattr(e, 'stderr', b'') or e}", file=sys.stderr)
        return None
    root = into / "before"
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    return root


# ----------------------------------------------------------------------------- the load (this process)


async def _post(port: int, path: str, body: dict) -> bytes:
    """The body of one HTTP/1.1 POST on a connection of its own, read whole until the server closes
    it (a bare socket reader: the load generator shares the machine, so it stays cheap)."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    parts: list[bytes] = []
    while chunk := await reader.read(1 << 16):
        parts.append(chunk)
    writer.close()
    head, _, raw = b"".join(parts).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"POST {path}: {head.splitlines()[0]!r} {raw[:200]!r}")
    if b"transfer-encoding: chunked" not in head.lower():
        return raw
    body_parts, at = [], 0
    while True:  # chunked transfer coding: hex size, CRLF, data, CRLF; a zero size ends it
        eol = raw.index(b"\r\n", at)
        size = int(raw[at:eol], 16)
        if size == 0:
            return b"".join(body_parts)
        body_parts.append(raw[eol + 2:eol + 2 + size])
        at = eol + 2 + size + 2


async def _one_stream(port: int, model: str, tokens: int) -> tuple[str, int, int]:
    """(text, completion tokens, SSE events) of one streamed chat completion."""
    body = {"model": model, "messages": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    raw = await _post(port, "/v1/chat/completions", body)
    text, used, events = [], 0, 0
    for event in raw.split(b"\n\n"):
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            continue
        events += 1
        chunk = json.loads(event[6:])
        if "error" in chunk:
            raise RuntimeError(f"the stream failed: {chunk['error']}")
        for choice in chunk["choices"]:
            text.append(choice["delta"].get("content") or "")
        if chunk.get("usage"):
            used = chunk["usage"]["completion_tokens"]
    return "".join(text), used, events


async def _load(port: int, model: str, streams: int, tokens: int) -> list[tuple[str, int, int]]:
    return await asyncio.gather(*[_one_stream(port, model, tokens) for _ in range(streams)])


def measure_round(server: Server, per_tick: int, streams: int, tokens: int, expected: str) -> dict:
    """One load on ``server``'s ``per_tick`` port: µs of its CPU per token, tokens per second, SSE events per token."""
    c0, t0 = server.cpu_s(), time.perf_counter()
    results = asyncio.run(_load(server.ports[per_tick], server.model, streams, tokens))
    wall, cpu = time.perf_counter() - t0, server.cpu_s() - c0
    total = sum(used for _, used, _ in results)
    if total != streams * tokens:
        raise RuntimeError(f"{server.name}: {total} tokens streamed, expected {streams * tokens}")
    wrong = sum(text != expected for text, _, _ in results)
    if wrong:
        raise RuntimeError(f"{server.name}: {wrong} of {streams} streams' text differs from the decoded tokens")
    return {"us_per_token": cpu / total * 1e6, "tok_s": total / wall,
            "events_per_token": sum(e for _, _, e in results) / total}


def expected_text(info, tokens: int) -> str:
    """What a reply of ``tokens`` tokens must read: the tokenizer's decode of the script's first ``tokens``."""
    script = script_tokens(info)
    ids = [script[i % len(script)] for i in range(tokens)]
    return info.tokenizer.decode(ids, skip_special_tokens=True)


def run(streams: int, tokens: int, rounds: int, per_ticks: list[int], before: Optional[str]) -> dict:
    """Every row: per ``per_tick``, the working tree against ``before`` (alternating rounds)."""
    from p2pserve.client.model_info import LocalModelInfo

    info = LocalModelInfo.load(None)
    expected, warm = expected_text(info, tokens), expected_text(info, 16)
    out: dict = {"streams": streams, "tokens_per_stream": tokens, "rounds": rounds, "before": before, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"after": REPO}
        old = checkout(before, Path(tmp)) if before else None
        if old is not None:
            trees["before"] = old
        servers = {name: Server(name, root, per_ticks, Path(tmp)) for name, root in trees.items()}
        try:
            for s in servers.values():  # warm-up: imports, first-request paths
                for per_tick in per_ticks:
                    measure_round(s, per_tick, 4, 16, warm)
            for per_tick in per_ticks:
                samples: dict[str, list[dict]] = {name: [] for name in servers}
                for r in range(rounds):
                    order = list(servers) if r % 2 == 0 else list(reversed(servers))
                    for name in order:
                        samples[name].append(measure_round(servers[name], per_tick, streams, tokens, expected))
                        print(f"per_tick {per_tick} round {r} {name}: {samples[name][-1]}", file=sys.stderr)
                out["rows"].append(_row(per_tick, samples))
        finally:
            for s in servers.values():
                s.close()
    return out


def _row(per_tick: int, samples: dict[str, list[dict]]) -> dict:
    """The medians of each tree's rounds, and their ratio."""
    row: dict = {"per_tick": per_tick}
    for name, got in samples.items():
        for key in ("us_per_token", "tok_s", "events_per_token"):
            row[f"{name}_{key}"] = round(statistics.median(g[key] for g in got), 2)
    if "before" in samples:
        row["ratio_after_over_before"] = round(row["after_us_per_token"] / row["before_us_per_token"], 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-tick", default="1,4", help="tokens ready per loop tick per stream, one row each")
    ap.add_argument("--before", default=DEFAULT_BEFORE, help="the baseline's commit ('none': no baseline)")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # the child process's mode
    args = ap.parse_args()
    if args.serve is not None:  # p2pserve comes from the PYTHONPATH the parent chose
        serve([int(x) for x in args.serve.split(",")])
        return
    sys.path.insert(0, str(REPO))
    before = None if args.before.lower() == "none" else args.before
    result = run(args.streams, args.tokens, args.rounds, [int(x) for x in args.per_tick.split(",")], before)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
