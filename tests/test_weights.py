"""The weights are fingerprinted by content: new weights at the same model.path never extend a folder.

One folder, three launches of one worker and a dry run: the first run records the weights; a folder of an older
run (its run.json without them) is resumed and records them then, with no weight file hashed again (the hash cache
says so); a transformer overwritten in place with other bytes of the same size and the same mtime (as `cp -p` of a
retrained checkpoint leaves it) is refused by the dry run and the real run alike, naming the component, and no
shard is written.
"""

import hashlib
import json
import os
import shutil

from conftest import PROMPTS, launch

COMPONENTS = {"text_encoder", "transformer", "vae"}  # the tiny FLUX.2's components that have weights


def _weight_files(model) -> list:
    return sorted(p for p in model.rglob("*.safetensors"))


def _cache(folder) -> dict:
    return json.loads((folder / "file_hashes.json").read_text())


def _done(out) -> list[str]:
    return sorted(p.name for p in (out / "state").glob("shard-*.json"))


def test_new_weights_at_the_same_path_are_refused_and_old_ones_are_not_hashed_again(
    tiny_model, tmp_path, launcher_main, monkeypatch, capsys
):
    model, cache, out = tmp_path / "model", tmp_path / "cache", tmp_path / "out"
    shutil.copytree(tiny_model, model)  # never touch the shared build
    env = {"MESHGEN_CACHE_DIR": str(cache)}
    job = [f"model.path={model}", f"output.dir={out}", PROMPTS, "mesh.tp=1", "run.shard_size=1"]

    res = launch(*job, "dataset.limit=2", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert set(run["settings"]["model"]["weights"]) == COMPONENTS
    # Each weight file's sha256, in the cache under its path.
    files = _weight_files(model)
    hashed = _cache(cache)
    for f in files:
        assert hashed[str(f.resolve())]["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest(), f
    when = {str(f.resolve()): hashed[str(f.resolve())]["hashed"] for f in files}

    # A folder of a run made before the weights were fingerprinted: its settings without them, its fingerprint
    # over those (sha256 of their sorted JSON, 16 hex digits, as run.json has always had it).
    old = {**run["settings"], "model": {k: v for k, v in run["settings"]["model"].items() if k != "weights"}}
    legacy = {
        **run,
        "settings": old,
        "fingerprint": hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16],
    }
    (out / "run.json").write_text(json.dumps(legacy))
    res = launch(*job, "dataset.limit=3", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(_done(out)) == 3
    assert (
        json.loads((out / "run.json").read_text())["settings"]["model"]["weights"]
        == run["settings"]["model"]["weights"]
    )
    hashed = _cache(cache)
    assert {p: hashed[p]["hashed"] for p in when} == when  # the rerun read no weight file again

    # A retrained transformer copied over the old one: other bytes, same size, same mtime, same inode.
    target = model / "transformer" / "diffusion_pytorch_model.safetensors"
    st = target.stat()
    with open(target, "r+b") as f:
        f.seek(-16, os.SEEK_END)
        tail = f.read(16)
        f.seek(-16, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in tail))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (target.stat().st_size, target.stat().st_mtime_ns, target.stat().st_ino) == (
        st.st_size,
        st.st_mtime_ns,
        st.st_ino,
    )
    before = {p.name: p.read_bytes() for p in (out / "data").iterdir()}
    states = _done(out)
    monkeypatch.setenv("MESHGEN_CACHE_DIR", str(cache))
    assert launcher_main(["--dry-run", *job, "dataset.limit=4"]) == 2
    assert "the weights of transformer changed" in capsys.readouterr().err
    res = launch(*job, "dataset.limit=4", env=env)
    assert res.returncode == 2, res.stderr[-3000:]
    [line] = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert f"model.path {model}: the weights of transformer changed since output.dir {out} was made" in line, line
    assert line.endswith("; choose a new output.dir or run.overwrite=true"), line
    assert _done(out) == states
    assert {p.name: p.read_bytes() for p in (out / "data").iterdir()} == before
    assert _cache(cache)[str(target.resolve())]["sha256"] == hashlib.sha256(target.read_bytes()).hexdigest()


def _hub_cache(root, repo: str, commit: str, files: dict[str, bytes]) -> None:
    """A Hugging Face cache holding one snapshot of `repo`, laid out as huggingface_hub documents it: refs/main
    names the commit, and each snapshot file links to a blob named by its etag (for LFS files, their sha256)."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / "blobs").mkdir()
    for name, data in files.items():
        etag = hashlib.sha256(data).hexdigest()
        (folder / "blobs" / etag).write_bytes(data)
        link = folder / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(folder / "blobs" / etag, link.parent))


def test_run_json_names_the_hub_revision_its_weights_came_from(tmp_path, monkeypatch):
    """DESIGN, run.json: a hub model is fingerprinted by its revision's etags; the revision is recorded with them."""
    from huggingface_hub import constants

    from launcher.config import load_config
    from launcher.ledger.runs import write_run_json
    from launcher.ledger.store import Store

    files = {
        "model_index.json": json.dumps({"transformer": ["diffusers", "X"]}).encode(),
        "transformer/diffusion_pytorch_model.safetensors": b"t" * 100,
    }
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    _hub_cache(tmp_path / "hub", "org/model", "5eed" * 10, files)
    cfg = load_config("tiny", ["model.path=org/model", "model.build=null"])
    write_run_json(Store(tmp_path / "out"), cfg, 1)
    recorded = json.loads((tmp_path / "out" / "run.json").read_text())
    assert recorded["model_revision"] == "5eed" * 10 and list(recorded["settings"]["model"]["weights"]) == [
        "transformer"
    ]


def test_a_hub_snapshot_is_fingerprinted_by_its_etags_without_reading_a_weight(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from launcher.weights import model_weights

    files = {
        "model_index.json": json.dumps({"transformer": ["diffusers", "X"], "vae": ["diffusers", "Y"]}).encode(),
        "transformer/diffusion_pytorch_model.safetensors": b"t" * 1000,
        "vae/diffusion_pytorch_model.safetensors": b"v" * 1000,
    }
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("MESHGEN_CACHE_DIR", str(tmp_path / "cache"))
    _hub_cache(tmp_path / "hub", "org/model", "c0ffee" * 6 + "abcd", files)
    hub = model_weights("org/model")
    assert hub.revision == "c0ffee" * 6 + "abcd"
    assert not (tmp_path / "cache").exists()  # nothing was hashed: the etags are the files' hashes
    # The same bytes in a folder give the same digests: the weights are named by content, wherever they are.
    for name, data in files.items():
        (tmp_path / "local" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "local" / name).write_bytes(data)
    assert model_weights(str(tmp_path / "local")).components == hub.components
    assert set(hub.components) == {"transformer", "vae"}
    # Another revision whose transformer differs: that component's digest changes, the VAE's does not.
    retrained = {**files, "transformer/diffusion_pytorch_model.safetensors": b"T" * 1000}
    _hub_cache(tmp_path / "hub2", "org/model", "beef" * 10, retrained)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub2"))
    other = model_weights("org/model")
    assert other.components["vae"] == hub.components["vae"]
    assert other.components["transformer"] != hub.components["transformer"]


def test_the_hash_cache_is_bounded_and_a_damaged_one_is_ignored(tmp_path, monkeypatch):
    from launcher import hashes

    monkeypatch.setenv("MESHGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hashes, "MAX_ENTRIES", 2)
    monkeypatch.setattr(hashes, "_MEMO", {})
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "file_hashes.json").write_text('{"half a file')
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"w{i}.safetensors")
        paths[-1].write_bytes(bytes([i]) * 100)
    assert hashes.files_sha256(paths) == [hashlib.sha256(bytes([i]) * 100).hexdigest() for i in range(3)]
    assert len(_cache(tmp_path / "cache")) == 2


def test_a_weight_file_that_cannot_be_read_is_one_line(tiny_model, tmp_path, monkeypatch):
    """An unreadable weight file (permissions, a copy replacing it) is exit 2 naming model.path, not a traceback."""
    import pytest

    import launcher.weights
    from launcher.errors import ConfigError

    def unreadable(files, what=""):
        raise PermissionError(13, "Permission denied", str(files[0]))

    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    monkeypatch.setattr(launcher.weights, "files_sha256", unreadable)
    with pytest.raises(ConfigError, match=rf"model.path {model}: cannot read its weights .*PermissionError"):
        launcher.weights.model_weights(str(model))
