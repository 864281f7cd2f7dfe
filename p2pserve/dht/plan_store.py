"""Publishing and reading a chunked plan (:mod:`p2pserve.dht.plan_chunks`) on the DHT.

Keys: the index under ``<swarm>/<model>/plan-index`` (one entry per coordinator, under its
owner subkey, like every record), each chunk under ``<swarm>/<model>/plan-chunk/<name>@<epoch>``
(the epoch of its content, so a chunk an index still references after a delta stays where it
was). Readers accept indexes and chunks signed by a trusted coordinator only (any signer in an
open swarm), the chunk from the same signer as the index, and check each chunk's digest against
the index (:func:`plan_chunks.assemble`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from p2pserve.dht import keys
from p2pserve.dht.plan_chunks import CHUNK_LIMIT_BYTES, PlanChunk, PlanIndex, assemble, decode_chunk, decode_index, encode, route_chunks
from p2pserve.dht.records import Plan
from p2pserve.dht.signing import is_trusted, trusted_set
from p2pserve.dht.swarm import Swarm
from p2pserve.errors import MalformedFrameError, RecordRejected


def index_key(swarm: Swarm) -> str:
    """Where the plan indexes of this swarm and model live."""
    return f"{keys.check_name(swarm.config.swarm_id, 'swarm id')}/{keys.model_slug(swarm.config.model)}/plan-index"


def chunk_key(swarm: Swarm, name: str, epoch: int) -> str:
    """Where chunk ``name`` made in ``epoch`` lives."""
    return f"{index_key(swarm)[:-len('plan-index')]}plan-chunk/{keys.check_name(name, 'chunk name')}@{epoch}"


async def publish_chunked(swarm: Swarm, index: PlanIndex, chunks: Sequence[PlanChunk]) -> bool:
    """Store ``chunks`` (the ones a delta says are new), then the index naming them."""
    ttl = swarm.config.plan_ttl
    ok = True
    for chunk in chunks:
        chunk.validate()
        ok &= await swarm.store_owned(chunk_key(swarm, chunk.name, chunk.epoch), encode(chunk), ttl)
    index.validate()
    data = encode(index)
    if len(data) > CHUNK_LIMIT_BYTES:
        raise RecordRejected(f"plan index of {len(data)} bytes exceeds {CHUNK_LIMIT_BYTES}")
    return ok and await swarm.store_owned(index_key(swarm), data, ttl)


async def read_index(swarm: Swarm) -> Optional[tuple[str, PlanIndex]]:
    """The highest-epoch valid index from a trusted signer, with its signer (None if none)."""
    trusted = trusted_set(swarm.config.trusted_coordinators)
    best: Optional[tuple[str, PlanIndex]] = None
    for signer, value, _exp in await swarm.fetch_owned(index_key(swarm)):
        if not is_trusted(signer, trusted):
            swarm.rejects.reject("plan-index", signer, "index signed by a key not in trusted_coordinators")
            continue
        try:
            index = decode_index(value)
        except (MalformedFrameError, RecordRejected) as e:
            swarm.rejects.reject("plan-index", signer, str(e))
            continue
        if index.model == swarm.config.model and (best is None or index.epoch > best[1].epoch):
            best = (signer, index)
    return best


async def read_route_plan(swarm: Swarm, group: Optional[str] = None) -> Optional[Plan]:
    """What a client needs for a route: the index, then only the chunks of one group
    (:func:`plan_chunks.route_chunks`), assembled into a Plan of that group."""
    found = await read_index(swarm)
    if found is None:
        return None
    signer, index = found
    refs = {r.name: r for r in index.chunks}
    chunks = {}
    for name in route_chunks(index, group):
        for who, value, _exp in await swarm.fetch_owned(chunk_key(swarm, name, refs[name].epoch)):
            if who != signer:
                continue
            try:
                chunks[name] = decode_chunk(value)
            except (MalformedFrameError, RecordRejected) as e:
                swarm.rejects.reject("plan-chunk", who, str(e))
    return assemble(index, chunks)
