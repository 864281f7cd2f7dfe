"""Several choices of one request (``n``), for the Python API.

The first choice runs alone until it is done with the prompt; the others then start together.
The peers hold the first one's KV blocks by then, so prefix sharing (``peer/prefix_share.py``)
gives the later choices the prompt's full blocks instead of new ones (the prompt's compute is
still repeated per choice: sessions are not forked). With sampling, choice i draws with seed
``seed + i``, so the choices differ and each is reproducible.
"""

from __future__ import annotations

import asyncio

SEED_SPACE = 1 << 62


async def choices(ask, n: int, *args, params, **kwargs) -> list:
    """``n`` replies of ``ask(*args, params=..., **kwargs)`` (``AsyncClient.chat`` or
    ``generate``), in choice order."""
    variants = [params if i == 0 or not params.temperature else params.with_sampling(seed=(params.seed + i) % SEED_SPACE)
                for i in range(n)]
    first = await ask(*args, params=variants[0], **kwargs)
    rest = await asyncio.gather(*(ask(*args, params=p, **kwargs) for p in variants[1:]))
    return [first, *rest]
