"""Hub ids without the hub: what a layer range needs, how ``--model`` reads as a hub id, and the
content-addressed checkpoint id that lets a hub id and a local copy meet.

``files_for_range`` must mirror ``Shard.load``: a folder holding only the files it names loads
the range, and leaving out any one of them does not (both a per-layer sharding and the
size-split sharding ``save_pretrained`` writes, for every tiny family; tied and untied heads).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest

from p2pserve.errors import ConfigError, UnknownModelError
from p2pserve.model import hub_manifest
from p2pserve.model.checkpoint_id import checkpoint_id, file_sha256
from p2pserve.model.hub import parse_hub_ref, with_revision
from p2pserve.model.hub_manifest import HubFile, Manifest
from p2pserve.model.layer_files import check_weight_map, files_for_range
from p2pserve.model.shard import Shard
from p2pserve.model.spec import load_spec
from p2pserve.model.tiny_families import TINY_FAMILY_NAMES, build_family_model
from p2pserve.testing.fake_hub import shard_by_layer

RANGES = [(0, 2), (2, 4), (4, 6), (0, 6), (3, 5)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Every tiny family as ``save_pretrained`` shards it (by size), and the untied Mistral one
    file per layer (``"mistral"``)."""
    root = tmp_path_factory.mktemp("hubfiles")
    built = {name: build_family_model(name, root / name, seed=0) for name in TINY_FAMILY_NAMES}
    return dict(built, mistral=shard_by_layer(built["mistral"], root / "mistral-by-layer"), llama3=built["llama3"])


def _only(folder: Path, files: set[str], dst: Path) -> Path:
    """A folder with ``folder``'s config and index and only ``files`` of its weights."""
    dst.mkdir()
    for name in ("config.json", "model.safetensors.index.json", *files):
        os.symlink(folder / name, dst / name)
    return dst


@pytest.mark.parametrize("family", sorted(set(TINY_FAMILY_NAMES) | {"mistral"}))
def test_the_files_a_range_needs_are_exactly_what_shard_load_reads(folders, family, tmp_path):
    folder = folders[family]
    spec = load_spec(folder)
    weight_map = check_weight_map(json.loads((folder / "model.safetensors.index.json").read_text()), "index")
    for start, end in RANGES:
        needed = files_for_range(weight_map, spec.num_layers, start, end, spec.tie_word_embeddings)
        Shard.load(str(_only(folder, needed, tmp_path / f"all-{start}-{end}")), spec, start, end)
        for left_out in needed:
            partial = _only(folder, needed - {left_out}, tmp_path / f"less-{start}-{end}-{left_out}")
            with pytest.raises(Exception):
                Shard.load(str(partial), spec, start, end)
    if family == "mistral":  # per-layer files: the last third needs its layers and the head only
        assert files_for_range(weight_map, 6, 4, 6, False) == {
            "model-layer-04.safetensors", "model-layer-05.safetensors", "model-head.safetensors"}


def test_an_index_may_not_steer_a_download_outside_the_snapshot():
    for bad in ("../x.safetensors", "sub/x.safetensors", "/etc/passwd", "x.bin", ""):
        with pytest.raises(ValueError):
            check_weight_map({"weight_map": {"model.norm.weight": bad}}, "index")
    with pytest.raises(ValueError):
        check_weight_map({"weight_map": []}, "index")


def test_what_reads_as_a_hub_id(tmp_path, monkeypatch):
    assert parse_hub_ref("Qwen/Qwen3-30B-A3B") == ("Qwen/Qwen3-30B-A3B", None)
    assert parse_hub_ref("Qwen/Qwen3-0.6B@v1.0") == ("Qwen/Qwen3-0.6B", "v1.0")
    for not_hub in (None, "", "default", "llama-3-8b", "a/b/c", "./a", "../a", "/abs/path", "org/name@../x",
                    "org/-name", str(tmp_path)):
        assert parse_hub_ref(not_hub) is None, not_hub
    (tmp_path / "org").mkdir()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir()
    assert parse_hub_ref("org/name") is None  # an existing folder wins over the hub
    assert with_revision("acme/m", "abc123") == "acme/m@abc123"
    assert with_revision("acme/m@main", "abc123") == "acme/m@abc123"
    assert with_revision("./anything", None) == "./anything"
    with pytest.raises(ConfigError, match="--revision"):
        with_revision(str(tmp_path), "main")


def test_the_revision_flag_is_folded_into_the_model():
    from p2pserve.cli import coordinator, peer
    from p2pserve.cli.common import fold_revision

    for module in (peer, coordinator):
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        args = p.parse_args(["--model", "acme/m", "--revision", "v2"])
        fold_revision(args)
        assert args.model == "acme/m@v2" and args.revision is None


def _snapshot(root: Path, repo: str, folder: Path, keep: set[str]) -> Path:
    """A Hugging Face cache layout of ``folder`` holding only ``keep`` (and config and index),
    each a symlink to a blob named by its SHA-256, as ``hf_hub_download`` leaves it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        if f.name in keep | {"config.json", "model.safetensors.index.json"}:
            blob = repo_dir / "blobs" / file_sha256(f)
            shutil.copy(f, blob)
            os.symlink(os.path.relpath(blob, snap), snap / f.name)
    return snap


def test_a_hub_snapshot_and_a_local_copy_have_one_id(folders, tmp_path, monkeypatch):
    monkeypatch.setenv("P2PSERVE_CACHE", str(tmp_path / "cache"))
    folder = folders["mistral"]
    want = load_spec(folder).model_id
    assert want.startswith("mistral-")
    copy = shutil.copytree(folder, tmp_path / "some-other-name")
    assert load_spec(copy).model_id == want  # the folder's name plays no part
    snap = _snapshot(tmp_path / "hf", "acme/tiny-mistral", folder, {"model-layer-05.safetensors"})
    with pytest.raises(UnknownModelError, match="online"):  # a partial snapshot, nothing recorded
        load_spec(snap)
    hub_manifest.record(Manifest("acme/tiny-mistral", snap.name, {
        f.name: HubFile(file_sha256(f) if f.suffix == ".safetensors" else None, f.stat().st_size)
        for f in folder.iterdir()}))
    assert load_spec(snap).model_id == want
    # the same config with one weight changed is another checkpoint
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(copy / "model-head.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, str(copy / "model-head.safetensors"), metadata={"format": "pt"})
    assert load_spec(copy).model_id != want


def test_a_local_dir_download_is_not_read_to_name_it(folders, tmp_path, monkeypatch):
    """``hf download --local-dir`` records each LFS file's digest beside it; that is used (a file
    changed since is read instead)."""
    monkeypatch.setenv("P2PSERVE_CACHE", str(tmp_path / "cache"))
    folder = shutil.copytree(folders["mistral"], tmp_path / "local-dir")
    want = load_spec(folder).model_id
    meta = folder / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    shutil.rmtree(tmp_path / "cache")  # nothing read before
    for f in folder.glob("*.safetensors"):
        (meta / f"{f.name}.metadata").write_text(f"{'0' * 40}\n{'ab' * 32}\n{f.stat().st_mtime + 5}\n")
    assert load_spec(folder).model_id != want  # the recorded (here: made-up) digests were used
    assert not (tmp_path / "cache" / "digests").exists()
    for f in folder.glob("*.safetensors"):
        (meta / f"{f.name}.metadata").write_text(f"{'0' * 40}\n{'ab' * 32}\n{f.stat().st_mtime - 5}\n")
    assert load_spec(folder).model_id == want  # stale records: the files are read


@pytest.mark.parametrize("family", ["llama3", "mistral"])
def test_the_profilers_stand_in_has_the_real_shards_shapes(folders, family):
    """A hub peer times stand-in layers instead of fetching the first layers' files: the same
    parameters, shapes, dtypes and head as ``Shard.load``, nothing left on the meta device."""
    from p2pserve.model.stand_in import stand_in_shard

    folder = folders[family]
    spec = load_spec(folder)
    for start, end in ((0, 2), (4, 6)):
        real, stand_in = Shard.load(str(folder), spec, start, end), stand_in_shard(str(folder), spec, start, end)
        shapes = {n: (tuple(p.shape), p.dtype) for n, p in real.named_parameters()}
        assert {n: (tuple(p.shape), p.dtype) for n, p in stand_in.named_parameters()} == shapes
        assert not any(t.is_meta for t in [*stand_in.parameters(), *stand_in.buffers()])
