"""A process fetching from a hub for the hub-fetch test: ``python -m tests.integration.hub_fetch STEPS_JSON``.

Each step opens a model as a peer would and fetches layer ranges, in this process's
``HF_HOME`` from its ``HF_ENDPOINT``; prints ``HUB_FETCH {json}`` with, per step, the model id
and the files each range fetched, or the error it raised.
"""

from __future__ import annotations

import json
import sys


def run(steps: list[dict]) -> list[dict]:
    from p2pserve.errors import P2PServeError
    from p2pserve.model.locate import open_model
    from p2pserve.model.spec import load_spec

    out = []
    for step in steps:
        try:
            source = open_model(step["model"], "peer")
            spec = load_spec(source.folder)
            got = {"model_id": spec.model_id, "fetched": []}
            for start, end in step.get("ranges", []):
                try:
                    got["fetched"].append(source.fetch_layers(spec, start, end))
                except P2PServeError as e:
                    got["fetched"].append({"error": str(e)})
        except P2PServeError as e:
            got = {"error": f"{type(e).__name__}: {e}"}
        out.append(got)
    return out


if __name__ == "__main__":
    print("HUB_FETCH " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
