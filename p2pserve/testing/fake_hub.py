"""A local HTTP server that speaks the part of the Hugging Face Hub's API ``huggingface_hub``
uses to fetch a model, serving checkpoint folders from disk.

Point ``HF_ENDPOINT`` at :attr:`FakeHub.endpoint` and ``hf_hub_download`` / ``model_info`` /
``snapshot_download`` work against it:

* ``GET /api/models/{repo}[/revision/{rev}]``: the model's info, its commit and, with
  ``?blobs=True``, each file's size, git blob id and LFS digest (``*.safetensors`` files are
  stored in LFS, as on the hub);
* ``HEAD /{repo}/resolve/{rev}/{path}``: the headers a download reads first (``X-Repo-Commit``,
  ``ETag`` / ``X-Linked-Etag``, ``Content-Length`` / ``X-Linked-Size``);
* ``GET /{repo}/resolve/{rev}/{path}``: the file's bytes (``Range`` honoured);
* unknown repositories, revisions and files answer 404 with the hub's ``X-Error-Code``.

Each repository has one commit, ``main``. Bytes sent are counted per client label: an endpoint
``{endpoint}/as/{label}`` is the same hub, with everything it sends counted under ``label``
(:meth:`FakeHub.endpoint_for`), so a test can tell which process fetched what.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_INFO = re.compile(r"^/api/models/([^/]+/[^/]+?)(?:/revision/([^/]+))?$")


class _Repo:
    """One checkpoint folder as a repository at one commit."""

    def __init__(self, repo_id: str, folder: Path):
        self.repo_id, self.folder = repo_id, Path(folder)
        self.files = sorted(p.name for p in self.folder.iterdir() if p.is_file())
        self.sha256 = {n: hashlib.sha256((self.folder / n).read_bytes()).hexdigest() for n in self.files}
        self.commit = hashlib.sha1(json.dumps([repo_id, sorted(self.sha256.items())]).encode()).hexdigest()

    def lfs(self, name: str) -> bool:
        return name.endswith(".safetensors")

    def blob_id(self, name: str) -> str:
        data = (self.folder / name).read_bytes()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def info(self, blobs: bool) -> dict:
        siblings = []
        for n in self.files:
            entry = {"rfilename": n}
            if blobs:
                size = (self.folder / n).stat().st_size
                entry.update(size=size, blobId=self.blob_id(n))
                if self.lfs(n):
                    entry["lfs"] = {"size": size, "sha256": self.sha256[n], "pointerSize": 134}
            siblings.append(entry)
        return {"id": self.repo_id, "modelId": self.repo_id, "sha": self.commit, "private": False,
                "tags": [], "siblings": siblings}


class FakeHub:
    """The server (a thread); ``sent[label]`` counts the body bytes sent to each client label,
    ``fetched[label]`` the files whose bytes it was sent, in order, and ``file_bytes[label][name]``
    the bytes of each file sent to it."""

    def __init__(self, repos: dict[str, Path], host: str = "127.0.0.1"):
        self.repos = {rid: _Repo(rid, folder) for rid, folder in repos.items()}
        self.sent: Counter[str] = Counter()
        self.fetched: dict[str, list[str]] = defaultdict(list)
        self.file_bytes: dict[str, Counter[str]] = defaultdict(Counter)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, 0), _Handler)
        self._server.daemon_threads = True
        self._server.hub = self  # the handler's way back to the repositories and counters
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)

    @property
    def endpoint(self) -> str:
        """The base URL (``HF_ENDPOINT``); what it sends is counted under the label ``""``."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def endpoint_for(self, label: str) -> str:
        """An ``HF_ENDPOINT`` whose traffic is counted under ``label`` (letters, digits, ``-_``)."""
        if not re.fullmatch(r"[\w-]+", label):
            raise ValueError(f"bad label {label!r}")
        return f"{self.endpoint}/as/{label}"

    def start(self) -> "FakeHub":
        """Start serving; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "FakeHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def count(self, label: str, name: str, n: int) -> None:
        """Add ``n`` body bytes of ``name`` sent to ``label``."""
        with self._lock:
            self.sent[label] += n
            if name:
                self.fetched[label].append(name)
                self.file_bytes[label][name] += n


class _Handler(BaseHTTPRequestHandler):
    """One request to the fake hub (the server's ``hub`` holds the repositories and counters)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet: tests read the counters
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        label = ""
        m = re.match(r"^/as/([\w-]+)(/.*)$", path)
        if m:
            label, path = m.group(1), m.group(2)
        if (info := _INFO.match(path)) is not None:
            self._info(info.group(1), info.group(2), "blobs=True" in self.path or "blobs=true" in self.path,
                       label, body)
        elif (res := _RESOLVE.match(path)) is not None:
            self._file(res.group(1), res.group(2), res.group(3), label, body)
        else:
            self._error(404, "EntryNotFound", body)

    def _repo(self, repo_id: str, revision, body: bool):
        repo = self.server.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", body)
        elif revision not in (None, "main", repo.commit):
            self._error(404, "RevisionNotFound", body)
        else:
            return repo
        return None

    def _info(self, repo_id: str, revision, blobs: bool, label: str, body: bool) -> None:
        repo = self._repo(repo_id, revision, body)
        if repo is not None:
            self._send(200, json.dumps(repo.info(blobs)).encode(), {"Content-Type": "application/json"},
                       body, label, "")

    def _file(self, repo_id: str, revision: str, name: str, label: str, body: bool) -> None:
        repo = self._repo(repo_id, revision, body)
        if repo is None:
            return
        if name not in repo.files:
            self._error(404, "EntryNotFound", body, {"X-Repo-Commit": repo.commit})
            return
        data = (repo.folder / name).read_bytes()
        headers = {"X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes",
                   "ETag": f'"{repo.blob_id(name)}"', "Content-Type": "application/octet-stream"}
        if repo.lfs(name):
            headers.update({"X-Linked-Etag": f'"{repo.sha256[name]}"', "X-Linked-Size": str(len(data))})
        status, rng = 200, self.headers.get("Range")
        if rng and (m := re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())):
            first, last = int(m.group(1)), int(m.group(2) or len(data) - 1)
            headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
            data, status = data[first:last + 1], 206
        self._send(status, data, headers, body, label, name)

    def _error(self, status: int, code: str, body: bool, extra: dict | None = None) -> None:
        self._send(status, json.dumps({"error": code}).encode(),
                   {"X-Error-Code": code, "Content-Type": "application/json", **(extra or {})}, body, None, "")

    def _send(self, status: int, data: bytes, headers: dict, body: bool, label, name: str) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)
            if label is not None:
                self.server.hub.count(label, name, len(data))



def shard_by_layer(src: Path, dst: Path) -> Path:
    """Copy the checkpoint folder ``src`` to ``dst`` with its weights re-sharded one file per
    decoder layer (``model-layer-NN.safetensors``), plus ``model-embed.safetensors`` (the
    embeddings) and ``model-head.safetensors`` (everything else: final norm, LM head), and an
    index naming them: a checkpoint where which files a layer range needs is plain to see."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from p2pserve.model.layer_files import EMBED, layer_of

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    groups: dict[str, dict] = defaultdict(dict)
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                layer = layer_of(name)
                fname = (f"model-layer-{layer:02d}.safetensors" if layer is not None
                         else "model-embed.safetensors" if name == EMBED else "model-head.safetensors")
                groups[fname][name] = handle.get_tensor(name).contiguous()
    weight_map, total = {}, 0
    for fname, tensors in sorted(groups.items()):
        save_file(tensors, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    return dst
