"""A checkpoint's id: what it is, not where it lies.

``<family>-<digest>``, the digest a SHA-256 over the bytes of ``config.json`` and the SHA-256 of
each weight file (the files its ``model.safetensors.index.json`` names, else every
``*.safetensors`` at its root). So a hub id, its snapshot in the Hugging Face cache, and a local
copy of the same files all give one id and meet in one swarm, while two checkpoints that differ
in any weight (a fine-tune with the base model's config) never do.

Where a weight file's digest comes from, cheapest first: the hub's listing recorded for a
snapshot folder (``model/hub_manifest.py``: a peer that fetched only its own layers knows the
others' digests from it); the blob a cache symlink points at (the Hugging Face cache names LFS
blobs by their SHA-256); the digest ``hf download --local-dir`` recorded beside a file; else
reading the file, once: the result is cached under ``$P2PSERVE_CACHE/digests`` by the file's
path, size and modification time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from p2pserve.errors import UnknownModelError
from p2pserve.model import hub_manifest
from p2pserve.model.default import cache_dir
from p2pserve.model.layer_files import check_weight_map, is_weight_file

INDEX = "model.safetensors.index.json"
DIGEST_CHARS = 12
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 16 << 20


def weight_files(folder: Path, listing: dict | None = None) -> list[str]:
    """The checkpoint's weight files: the index's, else the root ``*.safetensors`` (of the hub's
    ``listing`` when given, since a partial download lacks some)."""
    index = folder / INDEX
    if index.is_file():
        try:
            return sorted(set(check_weight_map(json.loads(index.read_text()), str(index)).values()))
        except ValueError as e:
            raise UnknownModelError(str(e)) from None
    names = listing.keys() if listing is not None else (p.name for p in folder.glob("*.safetensors"))
    return sorted(n for n in names if is_weight_file(n))


def checkpoint_id(folder: str | os.PathLike, family: str) -> str:
    """``<family>-<digest>`` of the checkpoint in ``folder`` (see the module docstring)."""
    folder = Path(folder)
    manifest = hub_manifest.for_folder(folder)
    listing = manifest.files if manifest is not None else None
    digests = []
    for name in weight_files(folder, listing):
        known = listing.get(name) if listing is not None else None
        if known is not None and known.sha256:
            digests.append((name, known.sha256))
        elif (folder / name).is_file():
            digests.append((name, file_sha256(folder / name)))
        else:
            raise UnknownModelError(f"{folder}: weight file {name} is neither here nor listed with its digest "
                                    "(for a hub id, run once online so the listing is recorded)")
    body = json.dumps({"config": hashlib.sha256((folder / "config.json").read_bytes()).hexdigest(),
                       "weights": digests}, sort_keys=True)
    return f"{family}-{hashlib.sha256(body.encode()).hexdigest()[:DIGEST_CHARS]}"


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes: the cache blob's name when ``path`` links into a Hugging Face
    cache, the recorded LFS digest of a file ``hf download --local-dir`` fetched and nobody
    changed since, else computed once and cached by (real path, size, modification time)."""
    real = path.resolve()
    if real.parent.name == "blobs" and _SHA256.match(real.name):
        return real.name
    recorded = _local_dir_etag(path)
    if recorded is not None:
        return recorded
    st = real.stat()
    key = hashlib.sha256(f"{real}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}".encode()).hexdigest()[:32]
    memo = cache_dir() / "digests" / key
    try:
        cached = memo.read_text().strip()
        if _SHA256.match(cached):
            return cached
    except OSError:
        pass
    h = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{key}.{os.getpid()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, memo)
    except OSError:  # a read-only cache costs a re-read next time, nothing else
        pass
    return digest


def _local_dir_etag(path: Path) -> str | None:
    """The LFS digest ``huggingface_hub`` recorded for ``path`` when it downloaded it into a
    local folder (``.cache/huggingface/download/NAME.metadata``: commit, etag, timestamp lines),
    if the file was not modified after (the 1 s slack is ``huggingface_hub``'s own)."""
    meta = path.parent / ".cache" / "huggingface" / "download" / f"{path.name}.metadata"
    try:
        _commit, etag, stamp = meta.read_text().splitlines()[:3]
        fresh = path.stat().st_mtime - 1 <= float(stamp)
    except (OSError, ValueError):
        return None
    etag = etag.strip().strip('"')
    return etag if fresh and _SHA256.match(etag) else None
