"""Where ``--model`` lies: a local checkpoint folder, the embedded default, or a hub id whose
files each role fetches as it needs them (``model/hub.py``).

A :class:`ModelSource` is the folder a role reads (for a hub id, its snapshot in the Hugging
Face cache) and, for a peer, the way to complete it: :meth:`ModelSource.fetch_layers` before
loading a layer range.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from p2pserve.model import hub_manifest
from p2pserve.model.default import Step, resolve_model
from p2pserve.model.hub import HubSnapshot, fetch_client_files, fetch_layers, open_snapshot, parse_hub_ref
from p2pserve.model.hub_manifest import HubFile, Manifest

Role = Literal["peer", "client"]


@dataclass
class ModelSource:
    """The checkpoint folder of a role's ``--model``; ``hub`` is set for a hub id, whose folder
    holds only what was fetched so far."""

    folder: Path
    hub: Optional[HubSnapshot] = None

    @property
    def partial(self) -> bool:
        """Whether some weight files may be missing from ``folder`` (a hub snapshot)."""
        return self.hub is not None

    def fetch_layers(self, spec, start: int, end: int) -> list[str]:
        """Make sure the files layers [start, end) of ``spec``'s model read are in the folder;
        returns the names fetched (nothing for a local folder)."""
        if self.hub is None:
            return []
        return fetch_layers(self.hub, spec.num_layers, start, end, spec.tie_word_embeddings)


def open_model(model: Optional[str], role: Role = "client", progress: Optional[Step] = None) -> ModelSource:
    """The source of ``model`` (a folder, ``default``/None, or ``ORG/NAME[@REVISION]``).

    For a hub id every role fetches the listing, ``config.json`` (an unsupported family fails
    here) and the index; a client (also a coordinator or ``status``) the tokenizer files and the
    generation config too; a peer then fetches weights per range with :meth:`ModelSource.fetch_layers`.
    A folder that is a snapshot in the Hugging Face cache (what a client of a hub id hands its
    peers) is that hub id at its commit: a peer fetches the files it lacks there too.
    """
    ref = parse_hub_ref(model)
    if ref is None:
        folder = resolve_model(model, progress)
        found = hub_manifest.snapshot_of(folder.resolve())
        if found is None or role != "peer":
            return ModelSource(folder)
        manifest = hub_manifest.recorded(*found) or Manifest(
            *found, {p.name: HubFile(None, None) for p in folder.iterdir()})
        return ModelSource(folder, HubSnapshot(manifest, folder, progress))
    snap = open_snapshot(*ref, progress=progress)
    if role == "client":
        fetch_client_files(snap)
    return ModelSource(snap.folder, snap)


def model_folder(model: Optional[str], progress: Optional[Step] = None) -> Path:
    """The folder a client reads for ``model``: tokenizer, configs (and no weights, for a hub id)."""
    return open_model(model, "client", progress).folder
