"""Hub model ids: ``--model ORG/NAME[@REVISION]`` fetched into the Hugging Face cache, one role's
files at a time.

Everything goes through ``huggingface_hub``, so the standard cache (``HF_HOME``,
``HF_HUB_CACHE``), ``HF_TOKEN``, ``HF_ENDPOINT`` and offline mode (``HF_HUB_OFFLINE=1``) behave
as in every other tool, and a download shows its progress bar. In order:

1. the repository's listing at the revision (one metadata request: the commit, each file's size
   and LFS digest), recorded for offline restarts (``model/hub_manifest.py``);
2. ``config.json``, whose family is checked at once: an unsupported family fails here, naming
   it, before any weight is fetched;
3. ``model.safetensors.index.json`` (which file holds which tensor);
4. per role: a client or a coordinator the tokenizer files and ``generation_config.json``
   (:func:`fetch_client_files`), a peer the weight files its layer range reads
   (:func:`fetch_layers`). Files already in the cache are kept and not fetched again, so a peer
   whose range moves fetches only what it lacks.

Every file is fetched at the listing's commit, so one snapshot folder holds them all and reads
like a local checkpoint folder.
"""

from __future__ import annotations

import json
import logging
import re
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from p2pserve.errors import UnknownModelError
from p2pserve.model import hub_manifest
from p2pserve.model.checkpoint_id import INDEX, weight_files
from p2pserve.model.default import Step
from p2pserve.model.hub_manifest import HubFile, Manifest
from p2pserve.model.layer_files import check_weight_map, files_for_range
from p2pserve.model.spec import check_supported

log = logging.getLogger(__name__)

CONFIG, GENERATION_CONFIG = "config.json", "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
_REVISION = re.compile(r"^[\w.][\w./-]{0,200}$")


def parse_hub_ref(model: Optional[str]) -> Optional[tuple[str, Optional[str]]]:
    """``(repo_id, revision)`` when ``model`` names a hub repository (``ORG/NAME``, optionally
    ``@REVISION``), None otherwise: an existing path, the default, or a name of another shape."""
    if not model or Path(model).expanduser().exists():
        return None
    repo, _, revision = model.partition("@")
    if not _REPO.match(repo) or ".." in repo or repo.endswith((".", "-")):
        return None
    if revision and (not _REVISION.match(revision) or ".." in revision):
        return None
    return repo, revision or None


def with_revision(model: Optional[str], revision: Optional[str]) -> Optional[str]:
    """``model`` pinned at ``--revision`` (``ORG/NAME@REVISION``); ``ConfigError`` unless it is a hub id."""
    from p2pserve.errors import ConfigError

    if revision is None:
        return model
    ref = parse_hub_ref(model)
    if ref is None:
        raise ConfigError(f"--revision {revision!r} applies to a hub model id (ORG/NAME), not to {model!r}")
    if not parse_hub_ref(f"{ref[0]}@{revision}"):
        raise ConfigError(f"--revision {revision!r} is not a branch, tag or commit name")
    return f"{ref[0]}@{revision}"


@dataclass
class HubSnapshot:
    """One commit of a hub repository, partly fetched into the cache's snapshot ``folder``."""

    manifest: Manifest
    folder: Path
    progress: Optional[Step] = None

    @property
    def repo_id(self) -> str:
        return self.manifest.repo_id

    def fetch(self, filename: str) -> Path:
        """``filename`` at this commit, downloaded unless the cache has it."""
        return _download(self.repo_id, filename, self.manifest.commit)

    def has_remote(self, filename: str) -> bool:
        """Whether the repository has ``filename`` (offline: whether the cache has it)."""
        return filename in self.manifest.files or (self.folder / filename).is_file()


def open_snapshot(repo_id: str, revision: Optional[str] = None, progress: Optional[Step] = None) -> HubSnapshot:
    """Steps 1-3 of the module docstring: the listing, ``config.json`` (family checked) and the index."""
    step = progress or (lambda what: nullcontext())
    with step(f"resolving {repo_id}" + (f"@{revision}" if revision else "") + " on the hub"):
        manifest = _listing(repo_id, revision)
    # config.json by the revision asked for (the cache then maps it to the commit, for offline
    # restarts), every later file by the listing's commit
    config = _download(repo_id, CONFIG, revision or "main")
    if config.parent.name != manifest.commit:
        raise UnknownModelError(f"{repo_id}@{revision or 'main'} moved to another commit while being resolved; retry")
    try:
        cfg = json.loads(config.read_bytes())
    except ValueError:
        raise UnknownModelError(f"{repo_id}: config.json is not JSON") from None
    check_supported(cfg if isinstance(cfg, dict) else {}, repo_id)  # before any weight is fetched
    snap = HubSnapshot(manifest, config.parent, progress)
    if snap.has_remote(INDEX):
        snap.fetch(INDEX)
    return snap


def fetch_client_files(snap: HubSnapshot) -> None:
    """Step 4 for a client or a coordinator: the tokenizer files and the generation config."""
    for name in TOKENIZER_FILES + (GENERATION_CONFIG,):
        if snap.has_remote(name):
            snap.fetch(name)


def fetch_layers(snap: HubSnapshot, num_layers: int, start: int, end: int, tied: bool) -> list[str]:
    """Step 4 for a peer: the weight files layers [start, end) read that the cache lacks.
    Returns the names fetched (none when the cache had them all)."""
    index = snap.folder / INDEX
    if index.is_file():
        try:
            weight_map = check_weight_map(json.loads(index.read_text()), f"{snap.repo_id}: {INDEX}")
        except ValueError as e:
            raise UnknownModelError(str(e)) from None
        needed = files_for_range(weight_map, num_layers, start, end, tied)
    else:  # one unsharded file (or several without an index): every layer needs all of them
        needed = set(weight_files(snap.folder, snap.manifest.files))
    missing = sorted(n for n in needed if not (snap.folder / n).is_file())
    if not missing:
        return []
    size = sum((snap.manifest.files.get(n) or HubFile(None, 0)).size or 0 for n in missing)
    step = snap.progress or (lambda what: nullcontext())
    with step(f"downloading {len(missing)} weight file(s), {size / 2**20:.1f} MiB, for layers {start}:{end} "
              f"of {snap.repo_id}"):
        for name in missing:
            snap.fetch(name)
    log.info("fetched %s for layers [%d, %d) of %s", ", ".join(missing), start, end, snap.repo_id)
    return missing


def _listing(repo_id: str, revision: Optional[str]) -> Manifest:
    """The listing of ``repo_id`` at ``revision``: from the hub, recorded; offline, as recorded
    (or, for a snapshot fetched by another tool, as its folder shows)."""
    from huggingface_hub import HfApi, constants

    if constants.is_offline_mode():
        return _cached_listing(repo_id, revision)
    info = _hub_call(repo_id, revision, lambda: HfApi().model_info(repo_id, revision=revision, files_metadata=True))
    files = {s.rfilename: HubFile(s.lfs.sha256 if s.lfs else None, s.size) for s in (info.siblings or [])}
    if not info.sha or not files:
        raise UnknownModelError(f"the hub answered no commit or no files for {repo_id}")
    manifest = Manifest(repo_id, info.sha, files)
    hub_manifest.record(manifest)
    return manifest


def _cached_listing(repo_id: str, revision: Optional[str]) -> Manifest:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, CONFIG, revision=revision)
    if not isinstance(found, str):
        raise UnknownModelError(f"offline (HF_HUB_OFFLINE) and {repo_id}" + (f"@{revision}" if revision else "")
                                + " is not in the Hugging Face cache: fetch it once online")
    folder = Path(found).parent
    manifest = hub_manifest.recorded(repo_id, folder.name)
    if manifest is None:
        manifest = Manifest(repo_id, folder.name, {p.name: HubFile(None, None) for p in folder.iterdir()})
    return manifest


def _download(repo_id: str, filename: str, commit: str) -> Path:
    from huggingface_hub import hf_hub_download

    return Path(_hub_call(repo_id, commit, lambda: hf_hub_download(repo_id, filename, revision=commit), filename))


def _hub_call(repo_id: str, revision: Optional[str], call, filename: str = ""):
    """Run a ``huggingface_hub`` call, turning its errors into ``UnknownModelError`` that say what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    what = f"{repo_id}" + (f"@{revision}" if revision else "") + (f": {filename}" if filename else "")
    for name in ("httpx", "httpx2"):  # a line per request at INFO drowns the peer's own; keep warnings
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        return call()
    except GatedRepoError:
        raise UnknownModelError(f"{what} is gated: accept its terms on the hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise UnknownModelError(f"{repo_id!r} is neither a folder here nor a model on the hub at {constants.ENDPOINT} "
                                "(a private one needs HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise UnknownModelError(f"{repo_id} has no revision {revision!r}") from None
    except Exception as e:  # noqa: BLE001 - network (httpx's own classes), disk, offline, a malformed answer
        raise UnknownModelError(f"could not fetch {what} from {constants.ENDPOINT}: {e}") from None
