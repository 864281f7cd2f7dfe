"""Several choices of one request (``n``), for the Python API.

The first choice runs its first step alone: the prompt, all of it. Every other choice then
opens its route as a fork of the first one's (``Pipeline.fork_from``, ``OpenSession.fork_of``):
the same peers, each session starting with the first choice's KV of the prompt but its last
position, shared copy-on-write. So the prompt is computed once, and each other choice computes
only the prompt's last position, whose logits it samples its own first token from. With
sampling, choice i draws with seed ``seed + i``, so the choices differ and each is reproducible.
"""

from __future__ import annotations

import asyncio

SEED_SPACE = 1 << 62


def choice_params(params, n: int) -> list:
    """The parameters of each of ``n`` choices: seed ``seed + i`` for choice i when sampling."""
    return [params if i == 0 or not params.temperature else params.with_sampling(seed=(params.seed + i) % SEED_SPACE)
            for i in range(n)]


async def choices(client, prompt_ids: list[int], params, n: int, drain) -> list:
    """``n`` replies after ``prompt_ids`` (``drain(generation)`` runs one to its reply and
    closes its pipeline), in choice order."""
    variants = choice_params(params, n)
    first = client.generation(prompt_ids, variants[0])
    rest: list = []
    try:
        try:
            await first.__anext__()  # the prompt ran: the peers hold its KV now
        except StopAsyncIteration:
            pass
        rest = [client.generation(prompt_ids, p, fork_of=first) for p in variants[1:]]
        # forked while the first choice waits between steps (its pipeline is idle)
        await asyncio.gather(*(g.pipeline.open() for g in rest))
        return list(await asyncio.gather(drain(first), *(drain(g) for g in rest)))
    finally:
        await asyncio.gather(*(g.pipeline.close() for g in [first, *rest]), return_exceptions=True)
