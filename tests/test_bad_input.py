"""Bad input (issue 9): exit 2, one clear last line on stderr, no traceback, nothing written, in seconds.

Every case runs the launcher's main() in this process, as a real run and as a dry run, which must say the same
line; a case of each kind also runs ./launch.sh as a user would (a fresh process: its exit code, its time, and
no traceback). `pytest -s` prints the slowest of those at the end.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest
from conftest import launch

from launcher.checks.settings import check_mesh, local_chip_count
from launcher.config import load_config
from launcher.errors import ConfigError

SECONDS = 20  # generous for a loaded 2-core machine; a model load or a network timeout would take longer
TIMES: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def report_slowest():
    yield
    if TIMES:
        case = max(TIMES, key=TIMES.get)
        print(f"\nslowest bad-input case: {case} in {TIMES[case]:.2f} s ({len(TIMES)} cases)")


@pytest.fixture(scope="session")
def bad(tmp_path_factory, tiny_model) -> Path:
    """Bad prompt sources and broken model folders, made once."""
    d = tmp_path_factory.mktemp("bad")
    files = {
        "empty.txt": b"",
        "blank.jsonl": b"\n  \n",
        "bad.jsonl": b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c",}\n',
        "bad.csv": b'prompt,seed\n"a, b",1\nc,2,3\n',
        "latin1.txt": b"a cat\nun caf\xe9\n",
        "seed.csv": b"prompt,seed\na,1\nb,x\n",
        "text.jsonl": b'{"text": "a", "lang": "en"}\n',
        "dup.jsonl": b'{"key": 1, "prompt": "a"}\n{"key": 7, "prompt": "b"}\n{"key": 7, "prompt": "c"}\n',
        "prompts.tsv": b"a\tb\n",
        "ok.txt": b"a\nb\n",
        "height.jsonl": b'{"prompt": "a", "height": 64}\n{"prompt": "b", "height": 100}\n',
        "huge.jsonl": b'{"prompt": "a"}\n{"prompt": "b", "height": 1000000, "width": 1024}\n',
    }
    for name, data in files.items():
        (d / name).write_bytes(data)
    (d / "not-a-pipeline").mkdir()
    (d / "not-a-pipeline" / "config.json").write_text("{}")
    # The tiny pipeline without its transformer's weights (a half-finished download), and with a broken config.
    for name, left_out in (("no-weights", "diffusion_pytorch_model.safetensors"), ("bad-config", "config.json")):
        for f in tiny_model.rglob("*"):
            dest = d / name / f.relative_to(tiny_model)
            if f.is_file() and f != tiny_model / "transformer" / left_out:
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.symlink_to(f)
    (d / "bad-config" / "transformer" / "config.json").write_text('{"num_attention_heads": 2,')
    (d / "hf-cache").mkdir()
    return d


# (overrides, what the last line must name); {bad} and {tmp} are filled in per case.
CASES = {
    # Mesh
    "dp-below-1": (["mesh.dp=0"], ["mesh.dp=0"]),
    "tp-below-1": (["mesh.tp=0"], ["mesh.tp=0"]),
    "tp-vs-transformer-heads": (["mesh.tp=4"], ["mesh.tp=4", "transformer", "num_attention_heads=2"]),
    "tp-vs-text-encoder-heads": (
        ["mesh.tp=3", "model.shard_transformer=false"],
        ["mesh.tp=3", "text encoder", "num_attention_heads=4"],
    ),
    "tp-vs-text-encoder-kv-heads": (
        ["mesh.tp=4", "model.shard_transformer=false"],
        ["mesh.tp=4", "text encoder", "num_key_value_heads=2"],
    ),
    "offload-with-tp": (["execution.offload=model"], ["execution.offload=model", "mesh.tp=2"]),
    # Dataset
    "dataset-missing": (["dataset.path={bad}/nope.txt"], ["dataset.path", "nope.txt", "does not exist"]),
    "dataset-empty-file": (["dataset.path={bad}/empty.txt"], ["empty.txt", "no prompts"]),
    "dataset-blank-lines-only": (["dataset.path={bad}/blank.jsonl"], ["blank.jsonl", "no prompts"]),
    "dataset-malformed-jsonl": (["dataset.path={bad}/bad.jsonl"], ["bad.jsonl", "line 3", "malformed JSON"]),
    "dataset-malformed-csv": (["dataset.path={bad}/bad.csv"], ["bad.csv", "line 3", "expected 2 fields", "got 3"]),
    "dataset-not-utf8": (["dataset.path={bad}/latin1.txt"], ["latin1.txt", "line 2", "UTF-8"]),
    "dataset-bad-seed-column": (["dataset.path={bad}/seed.csv"], ["seed.csv", "line 3", "'seed'", "'x'"]),
    "row-height-not-multiple": (["dataset.path={bad}/height.jsonl"], ["height.jsonl", "line 2", "height 100", "16"]),
    "row-size-too-large": (["dataset.path={bad}/huge.jsonl"], ["huge.jsonl", "line 2", "1024x1000000", "megapixels"]),
    "dataset-no-prompt-column": (
        ["dataset.path={bad}/text.jsonl"],
        ["text.jsonl", "dataset.prompt_column", "'prompt'", "columns found: text, lang"],
    ),
    "dataset-duplicate-ids": (
        ["dataset.path={bad}/dup.jsonl", "dataset.id_column=key"],
        ["dup.jsonl", "line 3", "duplicate id '7'", "line 2"],
    ),
    "dataset-missing-id-column": (["dataset.path={bad}/ok.txt", "dataset.id_column=key"], ["ok.txt", "'key'"]),
    "dataset-unknown-format": (["dataset.path={bad}/prompts.tsv"], ["prompts.tsv", "'.tsv'", ".jsonl"]),
    "dataset-limit-below-0": (["dataset.limit=-1"], ["dataset.limit=-1"]),
    # Model
    "model-path-missing": (["model.path={bad}/no-model", "model.build=null"], ["model.path", "no-model"]),
    "model-not-a-pipeline": (["model.path={bad}/not-a-pipeline"], ["not-a-pipeline", "model_index.json"]),
    "model-incomplete": (["model.path={bad}/no-weights"], ["no-weights", "transformer/", "weight files"]),
    "model-config-not-json": (
        ["model.path={bad}/bad-config"],
        ["bad-config/transformer/config.json", "not valid JSON"],
    ),
    "model-hub-id-not-cached": (
        ["model.path=nobody/not-a-model", "model.build=null"],
        ["nobody/not-a-model", "did not answer within 2 s", "HF_ENDPOINT", "hf download nobody/not-a-model"],
    ),
    # Generation settings
    "height-not-multiple": (["generate.height=72"], ["generate.height=72", "multiple of 16"]),
    "width-not-multiple": (["generate.width=100"], ["generate.width=100", "multiple of 16"]),
    "steps-below-1": (["generate.num_inference_steps=0"], ["generate.num_inference_steps=0"]),
    "batch-size-below-1": (["generate.batch_size=0"], ["generate.batch_size=0"]),
    "shard-size-below-1": (["run.shard_size=0"], ["run.shard_size=0"]),
    "negative-guidance": (["generate.guidance_scale=-1"], ["generate.guidance_scale=-1"]),
    "negative-batch-sleep": (["testing.batch_sleep_s=-1"], ["testing.batch_sleep_s=-1.0", "between 0 and 60"]),
    "nan-batch-sleep": (["testing.batch_sleep_s=nan"], ["testing.batch_sleep_s=nan", "between 0 and 60"]),
    "hold-in-no-folder": (
        ["testing.hold_batches_until={tmp}/no-such-folder/go"],
        ["testing.hold_batches_until=", "no-such-folder/go: its folder does not exist"],
    ),
    # Run and output
    "shards-that-do-not-exist": (["run.shards=[0,5]"], ["run.shards", "[5]", "3 shards"]),
    "output-dir-is-a-file": (["output.dir={tmp}/afile"], ["output.dir", "afile", "is a file"]),
    "output-dir-under-a-file": (["output.dir={tmp}/afile/out"], ["output.dir", "afile", "is a file"]),
    # /proc refuses new files even to root, for whom permission bits would not stop a write.
    "output-dir-not-writable": (["output.dir=/proc/meshgen-test/out"], ["output.dir", "cannot be written"]),
    "unknown-image-format": (["output.format=gif"], ["output.format", "'gif'", "png, jpeg, webp"]),
    "quality-above-100": (["output.format=jpeg", "output.quality=101"], ["output.quality=101", "1..100"]),
    "lossless-jpeg": (["output.format=jpeg", "output.lossless=true"], ["output.lossless", "webp", "lossy"]),
    "unknown-dtype": (["model.dtype=float8"], ["model.dtype", "'float8'", "bfloat16"]),
    "unknown-execution-mode": (["execution.mode=turbo"], ["execution.mode", "'turbo'", "eager"]),
    "unknown-device": (["device=gpu"], ["device", "'gpu'", "cuda"]),
    "tpu-without-torch-tpu": (["device=tpu"], ["device=tpu", "torch_tpu", 'pip install -e ".[tpu]"']),
    # Config
    "misspelt-key": (["generate.heigth=64"], ["generate.heigth", "did you mean generate.height"]),
    "added-unknown-key": (["+generate.foo=1"], ["generate.foo"]),
    "unknown-conf": (["conf=nope"], ["conf='nope'", "flux2_tp", "tiny"]),
    "unparsable-override": (["generate.height"], ["'generate.height'", "key=value"]),
}


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# Where a dry run cannot know what the real run finds: it makes no download and needs no torch_tpu. A fresh
# process only: the hub client reads its cache and endpoint from the environment once, at import.
DRY_RUN_DIFFERS = {"model-hub-id-not-cached", "tpu-without-torch-tpu"}
# A case of each kind through ./launch.sh (each costs a fresh interpreter): the two above; a prompt source that
# Arrow refuses (its thread pools once turned exit 2 into SIGABRT at interpreter exit), one that is not UTF-8, a
# row out of bounds; a mesh, a model folder, an output folder, a setting; a key, a conf, an override Hydra refuses.
PROCESS_CASES = sorted(DRY_RUN_DIFFERS) + [
    "dataset-malformed-csv",
    "dataset-not-utf8",
    "row-size-too-large",
    "tp-vs-transformer-heads",
    "model-incomplete",
    "output-dir-not-writable",
    "height-not-multiple",
    "misspelt-key",
    "unknown-conf",
    "unparsable-override",
]


@pytest.mark.parametrize("case", PROCESS_CASES)
def test_bad_input_exits_2_with_one_clear_line(case, tiny_model, bad, tmp_path, monkeypatch, request):
    overrides, expected = CASES[case]
    if case == "tpu-without-torch-tpu" and importlib.util.find_spec("torch_tpu"):
        pytest.skip("torch_tpu is installed here")
    env = {}
    if case == "model-hub-id-not-cached":
        # An empty cache, and a hub that never answers: the launcher asks it once, waits HF_HUB_ETAG_TIMEOUT, and
        # says so; with the library's retries (6 tries, each waiting, backoff between) it took over 5 minutes.
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        endpoint, paths = request.getfixturevalue("silent_hub")
        env = {"HF_HUB_CACHE": str(bad / "hf-cache"), "HF_ENDPOINT": endpoint, "HF_HUB_ETAG_TIMEOUT": "2"}
    (tmp_path / "afile").write_text("not a folder")
    before = tree(tmp_path)
    args = [f"model.path={tiny_model}", f"output.dir={tmp_path / 'out'}"]
    args += [o.format(bad=bad, tmp=tmp_path) for o in overrides]
    start = time.monotonic()
    res = launch(*args, env=env, timeout=120)
    TIMES[case] = time.monotonic() - start
    last = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ""
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert last.startswith("error: "), res.stderr[-3000:]
    for part in expected:
        assert part in last, f"{part!r} not in the last line: {last}"
    assert tree(tmp_path) == before and not (tmp_path / "out").exists()  # nothing written, not even a lock
    assert TIMES[case] < SECONDS, f"{case} took {TIMES[case]:.1f} s"
    if case == "model-hub-id-not-cached":  # asked once, never again, and no file of the repo
        assert [p for p in paths if "nobody" in p] == ["/api/models/nobody/not-a-model"], paths


# More processes than chips cannot be driven through launch.sh on this CPU-only machine: these tests give
# check_mesh a CUDA or TPU host by replacing the device and chip-count probes.
@pytest.mark.parametrize("device", ["cuda", "tpu"])
def test_more_processes_than_chips(device, monkeypatch):
    monkeypatch.setattr("launcher.worker.dist.resolve_device", lambda d: device)
    monkeypatch.setattr("launcher.checks.settings.local_chip_count", lambda d: 4 if d == device else None)
    check_mesh(load_config("tiny", [f"device={device}", "mesh.dp=2", "mesh.tp=2"]))  # 4 on 4 chips: fine
    with pytest.raises(ConfigError, match=rf"= 8 processes per host but this host has 4 {device} chips"):
        check_mesh(load_config("tiny", [f"device={device}", "mesh.dp=4", "mesh.tp=2"]))
    # Several hosts: only this host's share counts.
    check_mesh(load_config("tiny", [f"device={device}", "mesh.dp=4", "mesh.tp=2", "mesh.nodes=2"]))


def test_chip_counts_come_from_the_host_without_opening_a_chip(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert local_chip_count("cuda") == 2
    monkeypatch.delenv("TPU_VISIBLE_CHIPS", raising=False)
    # A v6e-8: eight chips, as /dev/vfio/0..7 (older TPUs show /dev/accel0..N instead).
    monkeypatch.setattr(
        "launcher.worker.dist.glob.glob", lambda p: [f"/dev/vfio/{i}" for i in range(8)] if "vfio" in p else []
    )
    assert local_chip_count("tpu") == 8
    monkeypatch.setenv("TPU_VISIBLE_CHIPS", "0,1")
    assert local_chip_count("tpu") == 2
    assert local_chip_count("cpu") is None


def test_a_cached_hub_id_passes_and_workers_stay_offline(tiny_model, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from launcher.checks.model_checks import check_model, locate

    def check(cfg):
        check_model(cfg, locate(cfg))

    # A hub cache holding the whole tiny pipeline under a made-up id, as `hf download` would leave it.
    repo = tmp_path / "models--nobody--tiny-flux2"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    for f in tiny_model.rglob("*"):
        if f.is_file():
            dest = repo / "snapshots" / commit / f.relative_to(tiny_model)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.symlink_to(f)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "")  # so that monkeypatch restores its absence after check_model sets it
    monkeypatch.delenv("HF_HUB_OFFLINE")
    check(load_config("tiny", ["model.path=nobody/tiny-flux2", "model.build=null"]))
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # inherited by the workers: no rank waits on the hub
    (repo / "snapshots" / commit / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(ConfigError, match="incomplete pipeline: vae/ lacks weight files"):
        check(load_config("tiny", ["model.path=nobody/tiny-flux2", "model.build=null"]))


def test_count_truncated_counts_tokens_as_the_pipeline_does(tiny_model):
    from diffusers import DiffusionPipeline
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    from jobs.text_to_image import count_truncated

    # The tiny tokenizer is byte-level: one token per UTF-8 byte, plus FLUX.2's chat template around the system
    # message and the prompt (<s>, [SYSTEM_PROMPT], [/SYSTEM_PROMPT], [INST], [/INST]: 5 special tokens).
    limit = 5 + len(SYSTEM_MESSAGE.encode()) + 10
    pipe = DiffusionPipeline.from_pretrained(tiny_model)
    max_length = pipe.tokenizer.model_max_length
    prompts = ["a" * 10, "a" * 11, "é" * 5, "é" * 6, "", "a" * 400]
    assert count_truncated(pipe, prompts, limit) == 3  # 11 bytes, 12 bytes, 400 bytes
    assert count_truncated(pipe, [], limit) == 0
    assert pipe.tokenizer.model_max_length == max_length  # the pipeline's tokenizer is left as it was


def test_every_bad_input_is_refused_by_the_real_run_and_by_a_dry_run_with_the_same_line(
    tiny_model, bad, tmp_path, monkeypatch, capsys, launcher_main
):
    """--dry-run walks the same preflight as the real run. In this process: one import of everything for all
    cases, where each launch.sh above pays it again."""
    main = launcher_main

    monkeypatch.setenv("HF_HUB_OFFLINE", "")  # restored after the cases that find the model in a cache set it
    (tmp_path / "afile").write_text("not a folder")
    before = tree(tmp_path)
    for case, (overrides, expected) in CASES.items():
        if case in DRY_RUN_DIFFERS:
            continue
        args = [f"model.path={tiny_model}", f"output.dir={tmp_path / 'out'}"]
        args += [o.format(bad=bad, tmp=tmp_path) for o in overrides]
        lines = []
        for dry in ([], ["--dry-run"]):
            assert main([*dry, *args]) == 2, (case, dry)
            err = capsys.readouterr().err.strip().splitlines()
            assert err and err[-1].startswith("error: "), (case, dry, err)
            lines.append(err[-1])
        for part in expected:
            assert part in lines[0], f"{case}: {part!r} not in the last line: {lines[0]}"
        assert lines[1] == lines[0], case  # the dry run says what the real run says
    assert tree(tmp_path) == before and not (tmp_path / "out").exists()


def test_a_folder_that_is_not_meshgens_is_refused_and_left_as_it_was(tiny_model, tmp_path, launcher_main, capsys):
    repo = tmp_path / "my-dataset"  # a cloned dataset repo: its own card and history
    (repo / ".git").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / "README.md").write_text("# my dataset\n")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in repo.rglob("*") if p.is_file()}
    res = launch(f"model.path={tiny_model}", f"output.dir={repo}", timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    [line] = res.stderr.strip().splitlines()
    assert line == (
        f"error: output.dir {repo} is not empty and is not a meshgen folder (no run.json; it holds .git, README.md); "
        "choose an empty or new folder"
    )
    assert launcher_main(["--dry-run", f"model.path={tiny_model}", f"output.dir={repo}"]) == 2
    assert capsys.readouterr().err.strip() == line
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in repo.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in repo.iterdir()) == [".git", "README.md"]


def test_a_folder_another_worker_is_starting_is_meshgens(tmp_path, monkeypatch):
    """Two workers started at once on a new folder (tests/test_workers.py): between this one's two looks the other
    is writing run.json (its temporary file, named for that host and process) or has just renamed it into place."""
    from launcher.errors import ConfigError
    from launcher.ledger.runs import check_ours
    from launcher.ledger.store import Store

    out = tmp_path / "out"
    (out / "locks").mkdir(parents=True)
    (out / "locks" / "worker-1.lock").write_text("{}")
    (out / ".run.json.tmp-node-b-4242").write_text("{")
    check_ours(Store(str(out)))
    (out / "README.md").write_text("# my dataset\n")  # but a file of someone else's beside it is still refused
    with pytest.raises(ConfigError, match=r"not a meshgen folder \(no run.json; it holds README.md\)"):
        check_ours(Store(str(out)))
    (out / "README.md").unlink()
    (out / ".run.json.tmp-node-b-4242").rename(out / "run.json")
    monkeypatch.setattr(Store, "exists", lambda self, rel: False)  # looked before the rename, listed after it
    check_ours(Store(str(out)))


@pytest.mark.parametrize("run_json", ['{"name": "my dataset"}', "[]", "not json"])
def test_a_run_json_meshgen_did_not_write_is_refused_and_left_as_it_was(
    run_json, tiny_model, tmp_path, launcher_main, capsys
):
    """A project's own file named run.json does not make its folder meshgen's: a resume would crash on it and
    run.overwrite would delete the folder's README.md and data."""
    repo = tmp_path / "my-dataset"
    (repo / "data").mkdir(parents=True)
    (repo / "data" / "train.parquet").write_bytes(b"PAR1")
    (repo / "README.md").write_text("# my dataset\n")
    (repo / "run.json").write_text(run_json)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in repo.rglob("*") if p.is_file()}
    for extra in ([], ["run.overwrite=true"], ["--dry-run"]):
        assert launcher_main([f"model.path={tiny_model}", f"output.dir={repo}", *extra]) == 2, extra
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: output.dir {repo} holds a run.json that meshgen did not write"), line
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in repo.rglob("*") if p.is_file()} == before
