"""A client process for the hub test: ``python -m tests.integration.hub_client SPEC_JSON``.

It joins the swarm with ``model`` given as a hub id (so it fetches that model's configs and
tokenizer from ``HF_ENDPOINT`` into its own ``HF_HOME``), waits for a plan routing over the
given peer ids, chats once greedily and prints one line ``HUB_CLIENT {json}`` with the reply's
tokens, prompt length, route and model id.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


async def main(spec: dict) -> dict:
    from p2pserve.client.api import AsyncClient
    from p2pserve.config import ClientConfig

    config = ClientConfig(hop_timeout_s=30.0, max_retries=3)
    async with AsyncClient(initial_peers=spec["boot"], model=spec["model"], swarm_id=spec["swarm_id"],
                           config=config, seed=0) as client:
        end = time.monotonic() + spec["deadline"]
        while True:
            await client.swarm_routes.refresh(force=True)
            plan = client.swarm_routes.plan
            if plan is not None and set(spec["peer_ids"]) <= set(plan.spans) and plan.max_flow > 0:
                break
            if time.monotonic() > end:
                raise TimeoutError("no plan routing over every peer")
            await asyncio.sleep(0.5)
        reply = await client.chat([{"role": "user", "content": spec["message"]}], max_new_tokens=spec["new_tokens"],
                                  ignore_eos=True)
        return {"tokens": reply.tokens, "prompt_tokens": reply.prompt_tokens, "model_id": client.model_id,
                "route": [[h.peer_id, h.start, h.end] for h in reply.route]}


if __name__ == "__main__":
    print("HUB_CLIENT " + json.dumps(asyncio.run(main(json.loads(sys.argv[1])))), flush=True)
