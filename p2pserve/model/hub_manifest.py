"""What the hub said about one commit of a repository, kept for when it cannot be asked.

A peer downloads only some of a checkpoint's weight files, yet the swarm's model name covers
all of them (``model/checkpoint_id.py``): their SHA-256 digests come from the hub's file
metadata (the Git LFS object ids). The listing is recorded here, per repository and commit, so
that a restart in offline mode (``HF_HUB_OFFLINE=1``) derives the same name from a partial
download. A snapshot folder of the Hugging Face cache (``.../models--ORG--NAME/snapshots/COMMIT``)
names its repository and commit, which is how a folder finds its listing.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from p2pserve.model.default import cache_dir

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class HubFile:
    """One file of a commit: its SHA-256 when the hub stores it in LFS (None otherwise), its size."""

    sha256: Optional[str]
    size: Optional[int]


@dataclass(frozen=True)
class Manifest:
    """The files of ``repo_id`` at ``commit``, by path in the repository."""

    repo_id: str
    commit: str
    files: dict[str, HubFile]

    def to_json(self) -> str:
        """The manifest as JSON (see :func:`manifest_from_json`)."""
        return json.dumps({"repo_id": self.repo_id, "commit": self.commit,
                           "files": {k: [v.sha256, v.size] for k, v in sorted(self.files.items())}})


def manifest_from_json(text: str) -> Manifest:
    """Parse :meth:`Manifest.to_json`'s output; raises ``ValueError`` on anything else."""
    raw = json.loads(text)
    files = {}
    for name, (sha, size) in raw["files"].items():
        if sha is not None and not _SHA256.match(str(sha)):
            raise ValueError(f"bad sha256 for {name!r}")
        files[str(name)] = HubFile(sha, None if size is None else int(size))
    return Manifest(str(raw["repo_id"]), str(raw["commit"]), files)


def _path(repo_id: str, commit: str) -> Path:
    return cache_dir() / "hub" / ("models--" + repo_id.replace("/", "--")) / f"{commit}.json"


def record(manifest: Manifest) -> None:
    """Keep ``manifest`` (atomically: several peers of one machine may record it at once)."""
    path = _path(manifest.repo_id, manifest.commit)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(manifest.to_json())
    os.replace(tmp, path)


def recorded(repo_id: str, commit: str) -> Optional[Manifest]:
    """The manifest recorded for ``repo_id`` at ``commit``, or None (none, or unreadable)."""
    path = _path(repo_id, commit)
    try:
        return manifest_from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def snapshot_of(folder: Path) -> Optional[tuple[str, str]]:
    """(repo id, commit) of a Hugging Face cache snapshot folder, or None for any other folder."""
    folder = Path(folder)
    repo_dir = folder.parent.parent
    if folder.parent.name != "snapshots" or not _COMMIT.match(folder.name) or not repo_dir.name.startswith("models--"):
        return None
    return repo_dir.name[len("models--"):].replace("--", "/"), folder.name


def for_folder(folder: Path) -> Optional[Manifest]:
    """The recorded manifest of a snapshot folder, or None."""
    found = snapshot_of(folder)
    return recorded(*found) if found else None
