"""Sessions that fork another pipeline's: the ``n`` choices of one prompt share its positions.

A fork is opened on each hop of the parent's route (``OpenSession.fork_of`` / ``fork_at``): the
peer shares the parent session's first positions copy-on-write, so the prompt runs once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional, Sequence

from p2pserve.client.connection import HopConnection
from p2pserve.config import ClientConfig
from p2pserve.protocol import SamplingParams
from p2pserve.transport import Transport

log = logging.getLogger(__name__)


async def open_forks(transport: Transport, config: ClientConfig, model_id: str, max_length: int,
                     sampling: SamplingParams, theirs: Sequence[HopConnection], at: int) -> Optional[list[HopConnection]]:
    """Sessions forking each of ``theirs`` at ``at`` positions, on the same hops; None, with
    nothing left open, when any could not be opened (an interruption is raised)."""
    links = [HopConnection(transport, c.hop, config.frame_limits, config.hop_timeout_s, config.connect_timeout_s)
             for c in theirs]
    opens = [c.open(model_id, None, max_length, sampling, fork=(p.session_id, at)) for c, p in zip(links, theirs)]
    failed = [r for r in await asyncio.gather(*opens, return_exceptions=True) if isinstance(r, BaseException)]
    if not failed:
        return links
    log.info("forking %d positions failed (%s); opening a route of its own", at, failed[0])
    await asyncio.gather(*(c.close() for c in links), return_exceptions=True)
    if any(not isinstance(r, Exception) for r in failed):
        raise failed[0]  # interrupted
    return None
