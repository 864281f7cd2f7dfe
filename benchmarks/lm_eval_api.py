"""lm-evaluation-harness through ``p2pserve api`` against the same harness in one process.

Starts three peers of a checkpoint (the embedded SmolLM2 unless ``--model``) and ``p2pserve api``
over them, runs the harness's log-likelihood multiple-choice task shipped in
``benchmarks/lm_eval_task`` (no downloads) with its ``local-completions`` model (``echo`` +
``logprobs`` over token ids, as it does against any OpenAI-compatible server), then the same
task with its ``hf`` model in this process (fp32), and compares the scores and every
log-likelihood. Writes JSON (``--out``).

    python benchmarks/lm_eval_api.py [--model PATH] [--out lm_eval_api.json]

Needs the ``lm-eval`` package (not in the test extra: it pulls in many packages).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASK = "p2pserve_mc_tiny"


def _task_dir(tmp: Path) -> Path:
    """The task's yaml and data, with the data file's path made absolute."""
    shutil.copy(HERE / "lm_eval_task" / "mc_tiny.jsonl", tmp / "mc_tiny.jsonl")
    text = (HERE / "lm_eval_task" / "mc_tiny.yaml").read_text().replace("mc_tiny.jsonl", str(tmp / "mc_tiny.jsonl"))
    (tmp / "mc_tiny.yaml").write_text(text)
    return tmp


def _start_api(path: str, peers) -> tuple[object, str]:
    from p2pserve.launch import Child

    spec = [f"{p.maddrs[0]}@{a}:{b}" for p, (a, b) in ((p, p.layers) for p in peers)]
    child = Child.spawn("api", ["api", "--port", "0", "--model", path, "--served-model-name", "m", "--peers", *spec])
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and child.alive:
        ready = [line for line in list(child.lines) if line.startswith("P2PSERVE_API_READY")]
        if ready:
            return child, dict(p.split("=", 1) for p in ready[0].split()[1:])["url"]
        time.sleep(0.05)
    child.stop()
    raise RuntimeError("the api server did not start:\n" + child.output())


def _evaluate(model, model_args: str, tasks_dir: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=1, log_samples=True,
                                  task_manager=TaskManager(include_path=str(tasks_dir)))
    samples = out["samples"][TASK]
    return {"results": {k: v for k, v in out["results"][TASK].items() if isinstance(v, (int, float))},
            "loglikelihoods": [[r[0][0] for r in s["resps"]] for s in samples]}


def _hf_model(path: str):
    """The harness's ``hf`` model over the checkpoint loaded here in fp32 (lm-eval 0.4.13's own
    loading passes transformers 5 a ``gguf_file=None`` it refuses)."""
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(path), batch_size=1, device="cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded SmolLM2)")
    ap.add_argument("--out", default="lm_eval_api.json")
    args = ap.parse_args()
    from p2pserve.launch import start_peers
    from p2pserve.model.default import resolve_model
    from p2pserve.model.spec import load_spec

    path = str(resolve_model(args.model))
    layers = load_spec(path).num_layers
    cuts = [0, layers // 3, 2 * layers // 3, layers]
    with tempfile.TemporaryDirectory() as tmp:
        tasks_dir = _task_dir(Path(tmp))
        peers = start_peers(path, list(zip(cuts, cuts[1:])))
        server = None
        try:
            server, url = _start_api(path, peers)
            t0 = time.perf_counter()
            swarm = _evaluate("local-completions", f"model=m,base_url={url}/v1/completions,tokenizer={path},"
                              "tokenized_requests=True,num_concurrent=1,max_retries=1", tasks_dir)
            swarm_s = time.perf_counter() - t0
        finally:
            if server is not None:
                server.stop()
            for p in peers:
                p.stop()
        t0 = time.perf_counter()
        local = _evaluate(_hf_model(path), "", tasks_dir)
        local_s = time.perf_counter() - t0
    diffs = [abs(a - b) for sa, sb in zip(swarm["loglikelihoods"], local["loglikelihoods"]) for a, b in zip(sa, sb)]
    report = {"model": path, "peers": len(cuts) - 1, "swarm": swarm["results"], "hf": local["results"],
              "scores_equal": swarm["results"] == local["results"], "max_loglikelihood_diff": max(diffs),
              "requests": len(diffs), "swarm_s": round(swarm_s, 2), "hf_s": round(local_s, 2)}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    sys.exit(0 if report["scores_equal"] and report["max_loglikelihood_diff"] < 1e-3 else 1)


if __name__ == "__main__":
    main()
