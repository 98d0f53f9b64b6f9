"""Fast tests of the launcher's own functions (launcher/host/, checks/, sizing/, publish/), in this process, no
workers: the bounds a job is held to at planning, the preflight's refusals and downloads, the mesh plan, what the
dataset card says, the torchrun command, the books of a run that starts no worker, the workers' log files and
terminal. Expected values are worked out here from the words of DESIGN.md or of the module's own docstring, never
from the product's functions. These are the host, checks, sizing and publish rooms' tests under `make mutants`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import test_lora
from conftest import until
from omegaconf import OmegaConf

from launcher.errors import ConfigError

GIB, MIB = 1024**3, 1024**2


def work_cfg(shard_size=100, **generate):
    gen = {"height": 64, "width": 64, "batch_size": 2, "images_per_prompt": 2} | generate
    out = {"format": "png", "queue_shards": 2}
    return OmegaConf.create({"generate": gen, "run": {"shard_size": shard_size}, "output": out})


@pytest.fixture
def one_mib_an_image(monkeypatch):
    """Each image of the configured size estimated at exactly 1 MiB of files, so a shard's bytes are its images."""
    import launcher.sizing.space

    monkeypatch.setattr(launcher.sizing.space, "estimate_bytes", lambda cfg, images: images * MIB)


def test_a_shard_is_bounded_at_20_gib_of_files_and_the_fix_names_the_largest_shard_size(one_mib_an_image):
    from launcher.sizing.work_bounds import check_work

    roomy = 10**15  # the host's memory: only the shard bound is under test
    # 2 images a prompt: 10,240 prompts are 20,480 images, 20 GiB exactly, which is within the bound
    check_work(work_cfg(shard_size=10_240), procs_per_host=1, host_bytes=roomy)
    with pytest.raises(ConfigError) as e:
        check_work(work_cfg(shard_size=10_241), procs_per_host=1, host_bytes=roomy)
    assert str(e.value) == (
        "one shard would hold 20482 images (run.shard_size=10241 x generate.images_per_prompt=2 x 1 sweep variants)"
        " at up to 64x64: about 20.0 GiB of png files, above the 20 GiB bound of one shard; use "
        "run.shard_size=10240 or less"
    )


def test_a_sweep_to_a_larger_size_counts_its_variants_and_its_largest_images(one_mib_an_image):
    from launcher.sizing.work_bounds import check_work

    # 3 variants of 2 images a prompt, the largest 128x64: each prompt 6 images of up to 2 MiB, 12 MiB a prompt
    cfg = work_cfg(shard_size=1707, sweep={"height": [32, 128, 64]})
    check_work(work_cfg(shard_size=1706, sweep={"height": [32, 128, 64]}), procs_per_host=1, host_bytes=10**15)
    with pytest.raises(
        ConfigError,
        match=r"^one shard would hold 10242 images \(run.shard_size=1707 x "
        r"generate.images_per_prompt=2 x 3 sweep variants\) at up to 128x64: .* use "
        r"run.shard_size=1706 or less$",
    ):
        check_work(cfg, procs_per_host=1, host_bytes=10**15)


def test_a_prompt_whose_images_alone_pass_the_bound_asks_for_fewer_images(monkeypatch):
    import launcher.sizing.space
    from launcher.sizing.work_bounds import check_work

    monkeypatch.setattr(launcher.sizing.space, "estimate_bytes", lambda cfg, images: images * 11 * GIB)
    with pytest.raises(ConfigError, match="22.0 GiB .* use fewer generate.images_per_prompt or sweep values$"):
        check_work(work_cfg(shard_size=1), procs_per_host=1, host_bytes=10**15)


def test_one_call_is_bounded_by_half_the_hosts_memory_over_its_processes(one_mib_an_image):
    from launcher.sizing.work_bounds import check_work

    # 2 x 2 images of 64x64x3 values, each held as float32 (4 bytes), then in up to queue_shards + 2 = 4 uint8
    # copies: 4 * 12,288 * 8 = 393,216 bytes; half of the host over 3 processes must hold that
    held = 4 * 64 * 64 * 3 * (4 + 2 + 2)
    check_work(work_cfg(), procs_per_host=3, host_bytes=held * 2 * 3)
    with pytest.raises(ConfigError) as e:
        check_work(work_cfg(), procs_per_host=3, host_bytes=held * 2 * 3 - 6)
    assert str(e.value).startswith(
        "one pipeline call makes 4 images (generate.batch_size=2 x generate.images_per_prompt=2) at up to 64x64: "
        "a worker holds about 0.0 GiB of them (the call's float32 output, then up to output.queue_shards=2 + 2 "
        "batches as uint8), above 0.0 GiB (half of this host's 0 GiB over its 3 processes); use a smaller "
        "generate.batch_size or generate.images_per_prompt"
    )
    # the largest swept width counts, and no process count divides by zero
    with pytest.raises(ConfigError, match=r"at up to 64x128: "):
        check_work(work_cfg(sweep={"width": [128]}), procs_per_host=0, host_bytes=held * 2 * 2 - 2)
    check_work(work_cfg(sweep={"width": [128]}), procs_per_host=0, host_bytes=held * 2 * 2)


def test_the_card_names_hub_models_and_sources_by_address_and_local_ones_without_their_folder(tmp_path):
    from launcher.publish.card_facts import is_hub_id, model_name, public, source_name

    assert is_hub_id("black-forest-labs/FLUX.1-schnell") and model_name("org/m_1.5") == "`org/m_1.5`"
    (tmp_path / "org" / "model").mkdir(parents=True)  # a local folder that looks like a Hub id is local
    assert not is_hub_id(str(tmp_path / "org" / "model")) and not is_hub_id("a/b/c") and not is_hub_id("ab")
    assert model_name("/models/tiny") == "a local pipeline (its weights by content below)"
    assert model_name("/models/tiny", local="local") == "local"
    assert source_name("hf://datasets/org/prompts/a.csv") == "`hf://datasets/org/prompts/a.csv`"
    assert source_name("/home/me/data/prompts.csv") == "`prompts.csv`" == source_name("C:\\data\\prompts.csv")
    assert source_name("s3://bucket/set/") == "`set`"
    # a setting may hold a path anywhere in it: only its last part is shown, Hub addresses and plain values as set
    got = public({"a": ["/x/y.lora", "hf://org/r/f", 3, "plain"], "b": {"c": "d\\e"}, "n": None})
    assert got == {"a": ["y.lora", "hf://org/r/f", 3, "plain"], "b": {"c": "e"}, "n": None}


def test_the_cards_settings_are_every_fingerprinted_value_but_the_models_and_weights_by_digest():
    from launcher.publish.card_facts import settings_lines, weights_lines

    settings = {
        "model": {"path": "/m", "weights": {"vae": "sha-v", "transformer": "sha-t"}, "loras": [1], "dtype": "bf16"},
        "generate": {"seed": 0, "negative_prompt": None, "height": 32},
        "output": None,
        "dataset": {"path": "/data/p.csv"},
    }
    assert weights_lines(settings) == "\n- weights of transformer: `sha-t`\n- weights of vae: `sha-v`"
    assert weights_lines({"model": {}}) == weights_lines({}) == ""
    assert settings_lines(settings) == (
        "- model.dtype: bf16\n- generate.seed: 0\n- generate.height: 32\n- dataset.path: p.csv"
    )


def test_the_cards_runs_are_listed_by_start_with_what_each_made(tmp_path):
    from launcher.ledger.store import Store
    from launcher.publish.card_facts import runs_section

    runs = tmp_path / "runs"
    runs.mkdir()
    later = {"start": "2026-12-02T10:00", "exit_code": 3, "generated": 5, "failed_now": ["1", "4"], "images": 6}
    later |= {"stale": 2, "rejected": {"r1": "x", "r2": "y"}, "damaged_regenerated": ["3"]}
    earlier = {"start": "2026-12-01T10:00", "exit_code": 0, "generated": 2, "images": 4, "rejected": 7}
    (runs / "b-run.json").write_text(json.dumps(later))
    (runs / "z-run.json").write_text(json.dumps(earlier))
    (runs / "damaged.json").write_text("{not json")
    (runs / "notes.txt").write_text("{}")
    assert runs_section(Store(tmp_path)).splitlines()[3:] == [
        "| started | exit | shards made | images | failed | stale (kept) | rejected rows | damaged, regenerated |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        "| 2026-12-01T10:00 | 0 | 2 | 4 | 0 | 0 | 7 | 0 |",
        "| 2026-12-02T10:00 | 3 | 3 | 6 | 2 | 2 | 2 | 1 |",
    ]
    assert runs_section(Store(tmp_path)).startswith("\nThe runs that made it, by start:\n\n")
    assert runs_section(Store(tmp_path / "none")) == ""


def test_the_dry_run_says_how_shards_spread_over_replicas_and_warns_of_idle_ones():
    from launcher.sizing.cost import replica_lines

    assert replica_lines(10, 40, 4, 2, 2) == [
        "# replicas: 4 (dp=2 x 2 workers); 10 shards to generate, 2.5 per replica"
    ]
    assert replica_lines(1, 3, 1, 1, 1) == ["# replicas: 1 (dp=1 x 1 worker); 1 shard to generate, 1.0 per replica"]
    assert replica_lines(0, 0, 8, 8, 1)[1:] == []  # nothing to generate: nobody idles for want of a shard
    # 3 shards of 21 prompts for 8 replicas: 5 idle; a shard of ceil(21 / 8) = 3 prompts makes 8 shards (7 full)
    assert replica_lines(3, 21, 8, 8, 1) == [
        "# replicas: 8 (dp=8 x 1 worker); 3 shards to generate, 0.4 per replica",
        "# warning: 5 of 8 replicas will sit idle: 3 shards for 8 replicas; run.shard_size=3 makes 8 shards of these"
        " 21 prompts (in a new output folder: the shard size is part of its fingerprint)",
    ]
    assert len(replica_lines(8, 8, 8, 8, 1)) == 1  # one shard each: none idle


def test_the_dry_runs_durations_and_sizes_take_the_largest_unit_they_fill():
    from launcher.sizing.cost import duration
    from launcher.sizing.space import size_text

    assert [duration(s) for s in (0.4, 59.6, 60, 5400, 3600 * 30, 86400 * 2.25)] == [
        "0 s",
        "60 s",
        "1.0 min",
        "1.5 h",
        "1.2 days",
        "2.2 days",
    ]
    assert [size_text(n) for n in (0, 1023, 1024, 1536 * 1024, 3 * GIB, 5 * 1024**4, 2048 * 1024**4)] == [
        "0 B",
        "1023 B",
        "1.0 KB",
        "1.5 MB",
        "3.0 GB",
        "5.0 TB",
        "2048.0 TB",
    ]


def test_a_models_bytes_on_disk_count_each_blob_once_and_skip_a_link_to_nothing(tmp_path):
    from launcher.sizing.cost import disk_bytes

    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc" / "unet"
    blobs.mkdir()
    snap.mkdir(parents=True)
    (blobs / "w").write_bytes(b"x" * 1000)
    (blobs / "c").write_bytes(b"y" * 24)
    (snap / "w.safetensors").symlink_to(blobs / "w")  # a hub snapshot links to its blobs
    (snap / "config.json").symlink_to(blobs / "c")
    (snap / "gone.bin").symlink_to(blobs / "not-downloaded")
    assert disk_bytes(tmp_path) == 1024 and disk_bytes(tmp_path / "snapshots") == 1024


def test_the_output_line_says_the_images_size_the_room_and_warns_when_they_do_not_fit(tmp_path):
    from launcher.ledger.store import Store
    from launcher.sizing.cost import output_lines

    cfg = OmegaConf.create({"generate": {"height": 100, "width": 100}, "output": {"format": "jpeg"}})
    # JPEG is 0.35 bytes a pixel (space.py's docstring): 1,000 images of 100x100 are 3,500,000 bytes = 3.3 MB
    lines = output_lines(cfg, Store(tmp_path / "out"), 1000)
    assert lines[0].startswith(f"# output: about 3.3 MB for 1000 images (jpeg, 100x100) at {tmp_path / 'out'}; ")
    assert lines[0].endswith(" free there") and len(lines) == 1
    huge = output_lines(cfg, Store(tmp_path), 10**15)
    assert huge[1].startswith(f"# warning: {tmp_path} has ") and huge[1].endswith(
        " free but the images need about 3183231.5 TB: the run would stop when it is full; free some space or "
        "choose another output.dir"
    )
    assert (
        output_lines(cfg, None, 1)[0] == "# output: about 3.4 KB for 1 images (jpeg, 100x100) at None; free space"
        " not known there (an object store)"
    )


def test_hub_ids_are_org_name_or_name_and_anything_like_a_path_is_a_path():
    from launcher.sizing.model_files import looks_like_hub_id

    ids = ["black-forest-labs/FLUX.1-dev", "gpt2"]
    paths = ["/abs/model", "./rel", "../up", "~/home", "a/b/c", "org/name/", ".hidden"]
    assert [looks_like_hub_id(p) for p in ids + paths] == [True] * len(ids) + [False] * len(paths)


def pipeline_folder(root, transformer_files=("a.safetensors", "b.safetensors")):
    """A pipeline as on disk: model_index.json, a scheduler (configs only), a VAE with one weight file and a
    transformer whose index names two weight shards, of which `transformer_files` are there."""
    components = {"_class_name": "P", "scheduler": ["d", "S"], "vae": ["d", "V"], "transformer": ["d", "T"]}
    components["text_encoder_2"] = [None, None]  # an optional component the pipeline leaves out
    (root / "scheduler").mkdir(parents=True)
    (root / "scheduler" / "scheduler_config.json").write_text("{}")
    for name in ("vae", "transformer"):
        (root / name).mkdir()
        (root / name / "config.json").write_text("{}")
    (root / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"w")
    index = {"weight_map": {"x": "a.safetensors", "y": "b.safetensors", "z": "a.safetensors"}}
    (root / "transformer" / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    for f in transformer_files:
        (root / "transformer" / f).write_bytes(b"w")
    (root / "model_index.json").write_text(json.dumps(components))


def test_a_pipeline_missing_a_component_or_a_weight_shard_is_incomplete_by_file_names(tmp_path):
    from launcher.sizing.model_files import check_components, read_json

    pipeline_folder(tmp_path / "whole")
    check_components("m", tmp_path / "whole")
    pipeline_folder(tmp_path / "half", transformer_files=("a.safetensors",))
    with pytest.raises(ConfigError) as e:
        check_components("org/m", tmp_path / "half")
    assert str(e.value) == (
        "model.path org/m is an incomplete pipeline: transformer/ lacks weight files ['b.safetensors']; download "
        "the whole pipeline again"
    )
    # a weight file no index names makes the component whole (a repo may carry the index of another format)
    (tmp_path / "half" / "transformer" / "model.safetensors").write_bytes(b"w")
    check_components("org/m", tmp_path / "half")
    (tmp_path / "half" / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"^model.path org/m is an incomplete pipeline: vae/ lacks weight files;"):
        check_components("org/m", tmp_path / "half")
    pipeline_folder(tmp_path / "gone")
    (tmp_path / "gone" / "scheduler" / "scheduler_config.json").unlink()
    (tmp_path / "gone" / "scheduler").rmdir()
    with pytest.raises(ConfigError, match=f"lists scheduler but {tmp_path / 'gone' / 'scheduler'} is missing; "):
        check_components("m", tmp_path / "gone")
    assert read_json(tmp_path / "none.json") == {}
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'bad.json'} is not valid JSON .*; download the pipeline"):
        read_json(tmp_path / "bad.json")


def test_the_runs_numbers_count_its_shards_samples_seconds_and_stages():
    from launcher.host.metrics import numbers

    ours = {
        0: {"status": "done", "rows": 4, "seconds": 2.5, "finished_at": 100.0, "stages": {"denoise": 1.25}},
        1: {"status": "done", "rows": 6, "seconds": 4.0, "finished_at": 90.0, "stages": {"denoise": 2.0, "x": 1}},
        2: {"status": "failed", "rows": 3, "seconds": 1.0, "finished_at": 95.0},
        3: {"status": "failed"},  # failed before it knew its rows or time
    }
    assert numbers(ours, 4.0) == {
        "samples_done": 10,
        "samples_failed": 3,
        "shards_done": 2,
        "shards_failed": 2,
        "images_per_second": 2.5,
        "shard_seconds_count": 3,
        "shard_seconds_sum": 7.5,
        "shard_last_seconds": 2.5,  # the one finished last (at 100), not the longest
        "stage_seconds": {"denoise": 3.25, "x": 1},
        "run_seconds": 4.0,
    }
    assert numbers({}, 0.0)["images_per_second"] == 0.0 and numbers({}, 0.0)["shard_last_seconds"] is None


def test_the_textfile_is_what_prometheus_reads_and_is_rewritten_only_when_the_finished_shards_change(tmp_path, caplog):
    import time

    from prometheus_client.parser import text_string_to_metric_families

    from launcher.host.metrics import MetricsFile, numbers

    path = tmp_path / "textfile" / "meshgen.prom"
    m = MetricsFile(str(path), "/out", "r1", 12, start=time.monotonic() - 30.0)  # the run began 30 s ago
    m.update({})
    families = {f.name: f for f in text_string_to_metric_families(path.read_text())}
    planned = families["meshgen_samples_planned"]
    assert planned.type == "gauge" and planned.documentation == "Samples (images) this run set out to generate."
    assert [(s.labels, s.value) for s in planned.samples] == [({"output": "/out", "run_id": "r1"}, 12)]
    assert "meshgen_shard_last_seconds" not in families  # no shard finished: no value, no line
    assert [s.name for s in families["meshgen_shard_seconds"].samples] == [
        "meshgen_shard_seconds_count",
        "meshgen_shard_seconds_sum",
    ]
    path.write_text("read by the collector")
    m.update({})  # the same (no) finished shards: not written again
    assert path.read_text() == "read by the collector"
    m.update({0: {"status": "done", "rows": 2, "seconds": 1.0}})
    assert "meshgen_samples_done" in path.read_text() and [p.name for p in path.parent.iterdir()] == ["meshgen.prom"]
    families = {f.name: f for f in text_string_to_metric_families(path.read_text())}
    [run_s] = [s.value for s in families["meshgen_run_seconds"].samples]
    assert 30 <= run_s < 150  # the run's age, whatever the clock's origin
    m.final({**numbers({}, 1.0), "stage_seconds": {"vae_decode": 0.5}})
    assert 'meshgen_stage_seconds{output="/out",run_id="r1",stage="vae_decode"} 0.5' in path.read_text()
    path.unlink()
    path.parent.rmdir()
    path.parent.write_text("a file where the folder must be")
    with caplog.at_level("WARNING"):
        m.final(numbers({}, 1.0))  # monitoring never stops a run
    assert f"could not write output.metrics={path}" in caplog.text


def test_a_folders_summary_is_each_shards_outcome_and_the_totals_from_its_states(tmp_path):
    """launcher/publish/card.py's summarize, which the card, the report and the status tool read: every shard of
    run.json with what its state says, pending where it has none; a state from before `finished_at` finished when its
    file was written (`time_source` says so); time summed over the shards that ran, failed ones included."""
    import os

    from launcher.ledger.store import Store
    from launcher.publish.card import summarize

    (tmp_path / "state").mkdir()
    run_json = {"shards": 5, "config": {}, "settings": {}, "note": "kept whole"}  # DESIGN: config, shard count
    (tmp_path / "run.json").write_text(json.dumps(run_json))
    parquet = "data/shard-00000.parquet"
    states = {
        0: {"status": "done", "rows": 4, "seconds": 2.0, "images_per_s": 2.0, "finished_at": 1000.0, "run_id": "r1"}
        | {"stages": {"denoise": 1.5, "load": 1}, "data_bytes": 77, "files": {parquet: [70, "h"]}}
        | {"kept_fingerprint": "fp-new", "kept_ids": ["a"]},
        1: {"status": "failed", "rows": 2, "seconds": 3.0, "error": "  ValueError: boom\nTraceback ...", "attempts": 1},
        2: {"status": "done", "rows": 6, "seconds": 1.0, "timings": {"vae_decode": 0.25, "note": "x"}},
        4: {"status": "done", "rows": 1, "seconds": 0.5, "finished_at": 990.0},
    }
    for i, st in states.items():
        (tmp_path / "state" / f"shard-{i:05d}.json").write_text(json.dumps(st))
    os.utime(tmp_path / "state" / "shard-00002.json", (995.0, 995.0))
    os.utime(tmp_path / "state" / "shard-00001.json", (998.0, 998.0))
    s = summarize(Store(tmp_path))
    assert s["meta"] == run_json
    first, failed, old, pending, last = s["shards"]
    assert first == {
        "index": 0,
        "status": "done",
        "rows": 4,
        "seconds": 2.0,
        "images_per_s": 2.0,
        "error": "",
        "finished_at": 1000.0,
        "stages": {"denoise": 1.5, "load": 1.0},
        "data_bytes": 77,
        "parquet_size": 70,
        "run_id": "r1",
        "kept_stale": True,
        "kept_ids": ["a"],
    }
    assert failed["error"] == "ValueError: boom" and failed["finished_at"] == 998.0 and failed["kept_ids"] == []
    assert old["finished_at"] == 995.0 and old["stages"] == {"vae_decode": 0.25} and old["parquet_size"] is None
    assert pending == {
        "index": 3,
        "status": "pending",
        "error": "",
        "stages": {},
        "kept_stale": False,
        "kept_ids": [],
    } | {k: None for k in ("rows", "seconds", "images_per_s", "finished_at", "data_bytes", "parquet_size", "run_id")}
    assert last["kept_stale"] is False
    assert s["counts"] == {"done": 3, "failed": 1, "pending": 1}
    assert (s["images"], s["seconds"], s["images_per_s"]) == (11, 6.5, round(11 / 6.5, 3))
    # from the first shard's start (the last one's: 990 - 0.5) to the last finish (1000)
    assert s["span_seconds"] == 10.5 and s["time_source"] == "state file mtime"
    s = summarize(Store(tmp_path), states={0: states[0]})  # the launcher's own states: no state read
    assert [x["status"] for x in s["shards"]] == ["done", "pending", "pending", "pending", "pending"]
    assert s["images"] == 4 and s["counts"] == {"done": 1, "failed": 0, "pending": 4}
    with pytest.raises(FileNotFoundError, match="has no run.json; is it a meshgen output folder"):
        summarize(Store(tmp_path / "state"))


def test_the_card_says_how_images_are_stored_and_what_each_sweep_variant_is():
    from launcher.publish.card import files_section, sweep_text

    assert files_section({"format": "png", "png_level": 3, "row_group_size": 64}) == (
        "- images: png (lossless, zlib level 3), stored as the `image` column's bytes\n"
        "- `data/shard-NNNNN.parquet`: one per shard, in row groups of 64 rows (loaders read one group at a time; "
        "the last group of a shard may be smaller)"
    )
    both = files_section({"format": "jpeg", "quality": 80, "image_files": True})
    assert both == (
        "- images: jpeg (lossy, quality 80), stored as the `image` column's bytes and "
        "`images/shard-NNNNN/<id>.jpg` files (the same bytes)"
    )
    assert files_section({"format": "webp", "lossless": True, "png": True}).endswith(".webp` files (the same bytes)")
    assert files_section({"format": "webp", "quality": 90, "embed_images": False}) == (
        "- images: webp (lossy, quality 90), stored as `images/shard-NNNNN/<id>.webp` files; the `image` column's "
        "`path` names each"
    )
    assert sweep_text(None) == sweep_text({}) == ""
    text = sweep_text({"guidance_scale": [1.0, 4.0], "num_inference_steps": [4]})
    assert text == (
        "\nA sweep: every prompt at 2 combinations of settings (the `variant` column, v = 0: guidance_scale=1.0, "
        "num_inference_steps=4; 1: guidance_scale=4.0, num_inference_steps=4). A sample's id is `<base id>@<v>` and "
        "it has the base id's seed, so the variants of one image differ only in the swept settings.\n"
    )


def test_the_cards_license_loras_kept_stale_shards_and_feature_types():
    import pyarrow as pa

    from launcher.publish.card import _arrow_feature, _feature, _loras_lines, hub_license, kept_text, size_category

    assert hub_license("") == hub_license("  ") == {}
    assert hub_license(" Apache-2.0 ") == {"license": "apache-2.0"}
    assert hub_license("FLUX.1 [dev] Non-Commercial License https://example.org/LICENSE.md") == {
        "license": "other",
        "license_name": "flux-1-dev-non-commercial-license",
        "license_link": "https://example.org/LICENSE.md",
    }
    assert hub_license("https://x.org/l") == {
        "license": "other",
        "license_name": "model-license",
        "license_link": "https://x.org/l",
    }
    # the Hub's size categories: n<1K, 1K<n<10K, ... by the rows' count
    assert [size_category(n) for n in (0, 999, 1000, 10**6 - 1, 10**6, 10**10 + 1)] == [
        "n<1K",
        "n<1K",
        "1K<n<10K",
        "100K<n<1M",
        "1M<n<10M",
        "n>10B",
    ]
    model = {"loras": [{"path": "org/style-lora"}, {"path": "/disk/mine.safetensors"}]}
    hashed = {"model": {"loras": [{"scale": 0.8, "sha256": "aa"}, {"scale": -1.0, "sha256": "bb"}]}}
    assert _loras_lines(model, hashed) == (
        "\n- LoRA: `org/style-lora` at scale 0.8 (sha256 aa)\n- LoRA: a local file `mine.safetensors` at scale -1.0 "
        "(sha256 bb)"
    )
    assert _loras_lines({}, {}) == ""
    shards = [
        {"kept_stale": True, "kept_ids": [f"i{k}" for k in range(4)]},
        {"kept_stale": True, "kept_ids": ["j", "k"]},
    ]
    assert kept_text({"shards": shards + [{"kept_stale": False}]}) == (
        " 2 done shards are kept-stale (samples i0, i1, i2, i3, j and more): their prompts changed in the source "
        "after they were generated, and run.stale=keep kept the images of the prompts as they were."
    )
    assert kept_text({"shards": [{"kept_stale": True, "kept_ids": []}]}).startswith(" 1 done shards are kept-stale:")
    assert kept_text({"shards": [{"kept_stale": False}]}) == ""
    t = pa.struct(
        [("a", pa.float16()), ("b", pa.list_(pa.float64())), ("c", pa.large_list(pa.struct([("d", pa.int8())])))]
    )
    assert _arrow_feature(t) == {
        "struct": [
            {"name": "a", "dtype": "float16"},
            {"name": "b", "list": "float64"},
            {"name": "c", "list": [{"name": "d", "dtype": "int8"}]},
        ]
    }
    assert _arrow_feature(pa.float32()) == {"dtype": "float32"} and _arrow_feature(pa.string()) == {"dtype": "string"}
    assert _feature("image", {"_type": "Image"}) == {"name": "image", "dtype": "image"}
    assert _feature("seed", {"dtype": "int64", "_type": "Value"}) == {"name": "seed", "dtype": "int64"}
    assert _feature("reference", [{"path": {"dtype": "string", "_type": "Value"}}]) == {
        "name": "reference",
        "list": [{"name": "path", "dtype": "string"}],
    }


SETTINGS_REFUSED = {
    "output.metrics=/var/lib/m.txt": "output.metrics=/var/lib/m.txt must be a local file path ending in .prom "
    "(node-exporter's textfile collector reads *.prom), e.g. /var/lib/node_exporter/meshgen.prom",
    "output.metrics=s3://b/m.prom": "output.metrics=s3://b/m.prom must be a local file path ending in .prom "
    "(node-exporter's textfile collector reads *.prom), e.g. /var/lib/node_exporter/meshgen.prom",
    "generate.num_inference_steps=0": "generate.num_inference_steps=0 must be at least 1",
    "generate.batch_size=0": "generate.batch_size=0 must be at least 1",
    "run.shard_size=0": "run.shard_size=0 must be at least 1",
    "generate.max_sequence_length=0": "generate.max_sequence_length=0 must be at least 1",
    "generate.height=0": "generate.height=0 must be at least 1",
    "generate.width=-8": "generate.width=-8 must be at least 1",
    "generate.images_per_prompt=0": "generate.images_per_prompt=0 must be at least 1",
    "run.timeout_s=0": "run.timeout_s=0 must be at least 1",
    "run.max_attempts=0": "run.max_attempts=0 must be at least 1",
    "run.shards=[]": "run.shards=[] selects no shards; name some ([0,3]) or use pending, failed or all",
    "generate.guidance_scale=-1": "generate.guidance_scale=-1.0 is negative; use 0 or more",
    "testing.batch_sleep_s=60.5": "testing.batch_sleep_s=60.5 must be between 0 and 60 seconds",
    "testing.batch_sleep_s=-1": "testing.batch_sleep_s=-1.0 must be between 0 and 60 seconds",
    "model.dtype=fp8": "model.dtype='fp8' is not one of bfloat16, float16, float32",
    "run.on_error=retry": "run.on_error='retry' is not one of continue, abort",
    # output's encoding: DESIGN's formats and the encoders' own ranges (JPEG/WebP quality 1-100, zlib level 0-9,
    # libwebp method 0-6), each just outside its range
    "output.format=gif": "output.format='gif' is not one of png, jpeg, webp",
    "output.png_encoder=cv2": "output.png_encoder='cv2' is not one of imagecodecs, pil",
    "output.quality=0": "output.quality=0 must be in 1..100",
    "output.quality=101": "output.quality=101 must be in 1..100",
    "output.png_level=-1": "output.png_level=-1 must be in 0..9",
    "output.png_level=10": "output.png_level=10 must be in 0..9",
    "output.webp_method=-1": "output.webp_method=-1 must be in 0..6",
    "output.webp_method=7": "output.webp_method=7 must be in 0..6",
    "output.row_group_size=0": "output.row_group_size=0 must be >= 1",
    "output.lossless=true": "output.lossless=true applies to output.format=webp only (png is always lossless); "
    "drop it or use output.format=webp",
    # DESIGN's per-row bounds hold for the job's own values too: steps 1..1000, guidance 0..100
    "generate.num_inference_steps=1001": "generate.num_inference_steps=1001 must be an integer from 1 to 1000",
    "generate.guidance_scale=100.5": "generate.guidance_scale=100.5 must be a finite number from 0 to 100",
    "execution.mode=fast": "execution.mode='fast' is not one of eager, defer_and_fuse, compile",
    "execution.offload=sequential": "execution.offload='sequential' is not one of none, model",
    "execution.cache=deepcache": "execution.cache='deepcache' is not one of none, taylorseer, first_block, magcache",
    "device=mps": "device='mps' is not one of auto, tpu, cuda, cpu",
    "run.stale=ignore": "run.stale='ignore' is not one of error, regenerate, keep",
    "dataset.bad_rows=drop": "dataset.bad_rows='drop' is not one of refuse, skip",
    "generate.reference_fit=fill": "generate.reference_fit='fill' is not one of crop, pad, stretch",
    "job=inpaint": "job='inpaint' is not one of text_to_image, edit",
}


@pytest.mark.parametrize("override", SETTINGS_REFUSED)
def test_each_setting_out_of_its_range_is_one_line_naming_the_key_and_the_value(override):
    from launcher.checks.settings import check_settings
    from launcher.config import load_config

    with pytest.raises(ConfigError) as e:
        check_settings(load_config("tiny", [override]))
    assert str(e.value) == SETTINGS_REFUSED[override]


def test_of_several_unset_keys_or_bounds_the_first_is_the_line():
    from launcher.checks.settings import check_settings
    from launcher.config import load_config

    with pytest.raises(ConfigError) as e:
        check_settings(load_config("tiny", ["model.path=???", "dataset.path=???"]))
    assert str(e.value) == "dataset.path is not set; give it on the command line (dataset.path=...) or in the job"
    with pytest.raises(ConfigError) as e:
        check_settings(load_config("tiny", ["generate.num_inference_steps=2000", "generate.guidance_scale=101"]))
    assert str(e.value) == "generate.num_inference_steps=2000 must be an integer from 1 to 1000"


def test_a_lora_scale_sweep_passes_the_settings_for_a_configured_lora():
    """The settings check the sweep's LoRA indices against model.loras (the model check refuses the sweep later)."""
    from launcher.checks.settings import check_settings
    from launcher.config import load_config

    lora = ["model.loras=[{path:/x.safetensors,scale:0.5}]", "generate.sweep={lora_scale.0:[0.5,1.0]}"]
    check_settings(load_config("tiny", lora))


MESH_REFUSED = {
    ("mesh.dp=0", "mesh.tp=0"): "mesh.dp=0 and mesh.tp=0 must be at least 1 (processes = mesh.dp * mesh.tp)",
    ("mesh.nodes=0",): "mesh.nodes=0 must be at least 1 (processes = mesh.dp * mesh.tp)",
    ("mesh.dp=3", "mesh.tp=1", "mesh.nodes=2"): "mesh.dp * mesh.tp = 3 processes do not split evenly over mesh.nodes=2",
    ("mesh.dp=1", "mesh.tp=2", "execution.offload=model"): "execution.offload=model cannot combine with mesh.tp=2: "
    "offload moves whole models between host and chip; use mesh.tp=1 or execution.offload=none",
    ("mesh.dp=4", "mesh.tp=2", "mesh.nodes=1"): "mesh.dp * mesh.tp = 8 processes per host but this host has 4 tpu "
    "chips; lower mesh.dp or mesh.tp",
}


@pytest.mark.parametrize("mesh", MESH_REFUSED)
def test_the_meshs_numbers_and_this_hosts_chips(mesh, monkeypatch):
    from launcher.checks import settings
    from launcher.config import load_config

    monkeypatch.setattr(settings, "local_chip_count", lambda device: 4 if device == "tpu" else None)
    with pytest.raises(ConfigError) as e:
        settings.check_mesh(load_config("tiny", list(mesh)), "tpu")
    assert str(e.value) == MESH_REFUSED[mesh]


def test_a_mesh_that_fits_this_hosts_chips_or_is_checked_for_another_host_passes(monkeypatch):
    from launcher.checks import settings
    from launcher.config import load_config

    monkeypatch.setattr(settings, "local_chip_count", lambda device: 4 if device == "tpu" else None)
    settings.check_mesh(load_config("tiny", ["mesh.dp=8", "mesh.tp=1", "mesh.nodes=2"]), "tpu")  # 4 a host
    settings.check_mesh(load_config("tiny", ["mesh.dp=2", "mesh.tp=2", "execution.offload=none"]), "tpu")
    settings.check_mesh(load_config("tiny", ["mesh.dp=1", "mesh.tp=1", "execution.offload=model"]), "tpu")
    settings.check_mesh(load_config("tiny", ["mesh.dp=8", "mesh.tp=1"]), "tpu", host=False)  # another host's job


def test_an_output_dir_that_is_a_file_or_under_one_is_one_line_and_nothing_is_made(tmp_path):
    from launcher.checks.settings import check_output
    from launcher.config import load_config

    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(ConfigError) as e:
        check_output(load_config("tiny", [f"output.dir={f}"]))
    assert str(e.value) == f"output.dir {f} is a file; choose a folder"
    with pytest.raises(ConfigError) as e:
        check_output(load_config("tiny", [f"output.dir={f}/a/b"]))
    assert str(e.value) == f"output.dir {f}/a/b cannot be created: {f} is a file; choose another folder"
    check_output(load_config("tiny", [f"output.dir={tmp_path}/new/deeper"]))  # made later, by the run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_a_lossless_jpeg_is_refused_as_lossy():
    from launcher.checks.settings import check_settings
    from launcher.config import load_config

    with pytest.raises(ConfigError) as e:
        check_settings(load_config("tiny", ["output.format=jpeg", "output.lossless=true"]))
    assert str(e.value) == (
        "output.lossless=true applies to output.format=webp only (jpeg is lossy); drop it or use output.format=webp"
    )


@pytest.mark.parametrize(
    "edges",
    [
        ["output.quality=1", "output.png_level=0", "output.webp_method=0", "output.row_group_size=1"],
        ["output.quality=100", "output.png_level=9", "output.webp_method=6", "output.format=webp"],
        ["output.format=webp", "output.lossless=true", "output.png_encoder=pil", "output.row_group_size=100000"],
    ],
)
def test_output_settings_at_their_bounds_pass(edges):
    from launcher.checks.settings import check_settings
    from launcher.config import load_config

    check_settings(load_config("tiny", edges))


def test_settings_at_their_bounds_pass_and_a_testing_hold_file_needs_its_folder(tmp_path):
    from launcher.checks.settings import check_settings
    from launcher.config import load_config

    ones = [f"{k}=1" for k in ("generate.num_inference_steps", "generate.batch_size", "run.shard_size")]
    edges = ["testing.batch_sleep_s=60", "generate.guidance_scale=0", "run.shards=[0]", "output.metrics=/m.prom"]
    check_settings(load_config("tiny", [*ones, *edges, f"testing.hold_batches_until={tmp_path / 'go'}"]))
    gone = tmp_path / "no-folder" / "go"
    with pytest.raises(ConfigError) as e:
        check_settings(load_config("tiny", [f"testing.hold_batches_until={gone}"]))
    assert str(e.value) == (
        f"testing.hold_batches_until={gone}: its folder does not exist; name a file in an existing folder"
    )


def launch_cfg(dp=1, tp=2, nodes=1, mode="eager"):
    return OmegaConf.create(
        {
            "mesh": {"dp": dp, "tp": tp, "nodes": nodes},
            "execution": {"mode": mode, "compile_cache_dir": None},
            "dataset": {"path": "/data/p.txt"},
            "output": {"dir": "/data/out"},
            "model": {"path": "/models/m"},
        }
    )


def test_one_hosts_torchrun_command_starts_dp_times_tp_processes_with_one_thread_each(monkeypatch):
    """DESIGN's Launch: `dp * tp` processes on this host with torchrun; one host's rendezvous is standalone; on CPU
    each worker gets one thread unless OMP_NUM_THREADS is set; a dry run prints the environment, then the command."""
    from launcher.host.launch import launch_plan

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    plan_ = launch_plan(launch_cfg(dp=3, tp=2), "tiny", ["generate.seed=3"], "cpu")
    assert plan_.env == {"OMP_NUM_THREADS": "1"} and not plan_.tpu_launch_env and plan_.start == "forkserver"
    assert plan_.torchrun_args == [
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=6",
        "--max-restarts=0",
        "--monitor-interval=0.1",
        "-m",
        "launcher.worker.main",
        "conf=tiny",
        "generate.seed=3",
    ]
    assert plan_.describe(6, 1) == [
        "export OMP_NUM_THREADS=1",
        "# this host forks these workers from a server that has imported torch and diffusers once",
        "torchrun --standalone --nnodes=1 --nproc-per-node=6 --max-restarts=0 --monitor-interval=0.1 "
        "-m launcher.worker.main conf=tiny generate.seed=3",
    ]
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert launch_plan(launch_cfg(), "tiny", [], "cpu").env == {}  # the user's setting wins
    assert launch_plan(launch_cfg(), "tiny", [], "cuda").start == "subprocess"


def test_a_multi_host_command_names_each_hosts_rank_and_the_first_hosts_address(monkeypatch):
    """Every host runs the same command: its share of the processes, NODE_RANK and MASTER_ADDR from the scheduler
    (left as shell variables where it has not set them), MASTER_PORT 29500 unless set; TPU's launch env first."""
    from launcher.host.launch import launch_plan

    for var in ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    plan_ = launch_plan(launch_cfg(dp=4, tp=4, nodes=2, mode="defer_and_fuse"), "flux2_tp", [], "tpu")
    assert plan_.env == {"TORCH_TPU_DEFER_AND_FUSE": "1"}  # the execution mode's, never OMP_NUM_THREADS off CPU
    assert plan_.torchrun_args[:5] == [
        "--nnodes=2",
        "--node-rank=$NODE_RANK",
        "--master-addr=$MASTER_ADDR",
        "--master-port=29500",
        "--nproc-per-node=8",
    ]
    assert plan_.tpu_launch_env and plan_.start == "subprocess"
    assert plan_.describe(8, 2)[-2:] == [
        'eval "$(python -m torch.tpu.distributed)"  # TorchTPU launch env: set_tpu_launch_env(nnodes=2, '
        "nproc_per_node=8)",
        "torchrun --nnodes=2 '--node-rank=$NODE_RANK' '--master-addr=$MASTER_ADDR' --master-port=29500 "
        "--nproc-per-node=8 --max-restarts=0 --monitor-interval=0.1 -m launcher.worker.main conf=flux2_tp",
    ]
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.2")
    monkeypatch.setenv("MASTER_PORT", "29600")
    assert launch_plan(launch_cfg(dp=4, tp=4, nodes=2), "x", [], "tpu").torchrun_args[1:4] == [
        "--node-rank=1",
        "--master-addr=10.0.0.2",
        "--master-port=29600",
    ]


@pytest.mark.parametrize(
    ("argv", "taken", "left"),
    [
        (["--cfg", "job", "x=1"], True, ["x=1"]),
        (["y=2", "--cfg=job"], True, ["y=2"]),
        (["x=1"], False, ["x=1"]),
    ],
)
def test_cfg_job_is_taken_from_the_arguments_in_either_spelling(argv, taken, left):
    from launcher.host.launch import _take_cfg_flag

    argv = list(argv)  # the parameter's own list is the same object at each run of the test
    assert _take_cfg_flag(argv) is taken and argv == left


@pytest.mark.parametrize(("argv", "what"), [(["--cfg", "hydra"], "hydra"), (["--cfg"], "(nothing)")])
def test_cfg_of_anything_but_job_is_refused_naming_it(argv, what):
    from launcher.host.launch import _take_cfg_flag

    with pytest.raises(ConfigError) as e:
        _take_cfg_flag(argv)
    assert str(e.value) == f"--cfg {what}: only --cfg job is known here"


def test_the_rerun_command_has_absolute_paths_and_drops_the_shard_choice_and_overwrite():
    """A failed run's last line is the command that finishes it from any folder: launch.sh by its path, the paths
    the run resolved, the other overrides as given, without run.shards and run.overwrite."""
    from launcher.config import REPO_ROOT
    from launcher.host.launch import rerun_command

    overrides = ["dataset.path=p.txt", "+output.dir=out", "model.path=m", "run.shards=failed", "run.overwrite=true"]
    assert rerun_command(launch_cfg(), "tiny", [*overrides, "generate.seed=3"]) == [
        str(REPO_ROOT / "launch.sh"),
        "conf=tiny",
        "dataset.path=/data/p.txt",
        "output.dir=/data/out",
        "model.path=/models/m",
        "generate.seed=3",
    ]


def test_the_tpu_launch_env_needs_torch_tpu_0_2(monkeypatch):
    """Without torch.tpu.distributed: an install line, or an upgrade line where torch_tpu is older than 0.2.0."""
    import sys
    import types

    import torch

    from launcher.host.launch import set_tpu_launch_env

    monkeypatch.delattr(torch, "tpu", raising=False)
    monkeypatch.setitem(sys.modules, "torch_tpu", None)  # not installed
    with pytest.raises(ConfigError, match=r"^cannot set up the TPU launch environment: .*\(0\.2\.0 or newer\)$"):
        set_tpu_launch_env(1, 8)
    old = "torch_tpu._internal.distributed.launchers"
    for name in ("torch_tpu", "torch_tpu._internal", "torch_tpu._internal.distributed", old):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[old].singlehost_wrapper = object()  # ty: ignore[unresolved-attribute]
    with pytest.raises(ConfigError, match=r"^torch_tpu is older than 0\.2\.0 .*pip install -e \"\.\[tpu\]\"$"):
        set_tpu_launch_env(1, 8)


def test_help_and_cfg_job_print_and_exit_0_and_a_bad_cfg_is_exit_2(launcher_main, capsys):
    """DESIGN: `--help` lists the confs, groups and keys; `--cfg job` prints the composed config and exits 0."""
    assert launcher_main(["--help"]) == 0
    assert "conf=" in capsys.readouterr().out
    assert launcher_main(["--cfg", "job", "conf=tiny", "generate.seed=7"]) == 0
    job = OmegaConf.create(capsys.readouterr().out)
    assert job.generate.seed == 7 and job.mesh.tp == 2
    assert launcher_main(["--cfg", "all"]) == 2
    assert capsys.readouterr().err.strip() == "error: --cfg all: only --cfg job is known here"


def test_the_dry_run_says_the_device_mesh_plan_held_and_rejected_rows_then_this_hosts_share(monkeypatch):
    """DESIGN's Launch: a dry run prints how many shards and images the run would generate and, last before the
    command, `# workers: index=I count=N`; a shard held by run.max_attempts and rows set aside by
    dataset.bad_rows=skip are said there too (one example row named by file and line, or by position)."""
    from types import SimpleNamespace as NS

    from launcher.host.launch import dry_run_lines
    from launcher.sizing import cost

    monkeypatch.setattr(cost, "cost_lines", lambda pf: ["# cost: (cost lines)"])
    cfg = OmegaConf.create(
        {
            "device": "auto",
            "mesh": {"nodes": 1},
            "workers": {"index": 1, "count": 3},
            "generate": {"images_per_prompt": 3, "sweep": None},
        }
    )
    shards = [NS(status=s) for s in ("done", "failed", "pending", "stale", "failed", "done", "done")]
    rejected = [{"file": "a.csv", "line": 7, "position": 5, "reason": "an empty prompt"}, {"file": None}]
    plan = NS(selected=[1, 2, 3, 4], shards=shards, held=[4], rejected=rejected, prompts=lambda sel: 10 * len(sel))
    mesh = NS(chip=NS(name="v6e"), line=lambda: "# mesh: dp=1 tp=2 (v6e, 32 GiB per chip)", why=["auto: tp=2 fits"])
    pf = NS(cfg=cfg, plan=plan, device="cpu", mesh=mesh, notes=["# note: a note"])
    assert dry_run_lines(pf) == [
        "# device: cpu (device=auto), chip: v6e",
        "# mesh: dp=1 tp=2 (v6e, 32 GiB per chip)",
        "# mesh: auto: tp=2 fits",
        "# note: a note",
        "# plan: 4 of 7 shards to generate (40 prompts, 120 images); 3 done, 2 failed, 1 stale",
        "# not retried: shards [4] failed run.max_attempts times with the same error; run.shards=failed retries them",
        "# rejected: 2 rows set aside (dataset.bad_rows=skip), e.g. a.csv, line 7: an empty prompt",
        "# cost: (cost lines)",
        "# workers: index=1 count=3",
    ]
    plan.held, plan.rejected = [], [{"file": None, "line": None, "position": 12, "reason": "no prompt"}]
    lines = dry_run_lines(pf)
    assert not any(line.startswith("# not retried") for line in lines)
    assert "# rejected: 1 rows set aside (dataset.bad_rows=skip), e.g. row 12: no prompt" in lines


def test_a_run_that_selects_nothing_keeps_its_books_and_starts_no_worker(launcher_main, tiny_model, tmp_path, capsys):
    """A launch in this process where `run.shards=failed` selects no shard of a new folder: DESIGN's layout still
    gets run.json, the dataset card and the run's record (exit code 0: every selected shard is done), and nothing
    else: no state (no shard ran, so no index of states), no plan, and the worker's lock released (empty: on a
    local disk the file stays, and the lock is the flock on it)."""
    out = tmp_path / "out"
    args = ["conf=tiny", f"model.path={tiny_model}", f"output.dir={out}", "run.shards=failed", "generate.seed=5"]
    assert launcher_main(args) == 0, capsys.readouterr().err[-2000:]
    [record] = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    assert record["exit_code"] == 0
    assert json.loads((out / "run.json").read_text())["shards"] == 3  # conf tiny: 20 prompts, 8 a shard
    assert (out / "README.md").read_text().startswith("---\n")  # the card's Hub front matter
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [
        "README.md",
        "locks/worker-00000.lock",
        "run.json",
        f"runs/{record['run_id']}.json",
    ]
    assert (out / "locks" / "worker-00000.lock").read_bytes() == b""
    from launcher.config import REPO_ROOT

    launch_sh = str(REPO_ROOT / "launch.sh")  # the command that finishes the run: run.shards is not part of it
    assert record["command"] == [launch_sh, "conf=tiny", f"model.path={tiny_model}", f"output.dir={out}", args[-1]]


def test_overwrite_is_refused_while_another_worker_runs_and_else_discards_the_earlier_results(
    launcher_main, tiny_model, tmp_path, capsys
):
    """run.overwrite discards earlier results (DESIGN: data, states, records, the card) but never the work of a
    live run of another worker index: that is exit 4, naming the worker, its host and pid."""
    from launcher.ledger.lock import RunLock
    from launcher.ledger.store import Store

    out = tmp_path / "out"
    base = ["conf=tiny", f"model.path={tiny_model}", f"output.dir={out}", "run.shards=failed"]
    share = ["workers.index=0", "workers.count=2"]
    assert launcher_main([*base, *share]) == 0, capsys.readouterr().err[-2000:]
    [record] = (out / "runs").glob("*.json")
    first = record.rename(out / "runs" / "19990101T000000-elsewhere-1.json")  # the same process's ids may repeat
    (out / "data").mkdir()
    (out / "data" / "shard-00000.parquet").write_bytes(b"an earlier run's")
    with RunLock(Store(str(out)), 1, "the-other-run") as other:
        assert launcher_main([*base, *share, "run.overwrite=true"]) == 4
        host, pid = other.record["host"], other.record["pid"]
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"error: run.overwrite would discard the work of live worker 1 (host {host}, pid {pid}); "
            "wait for it or stop it first"
        )
    assert first.exists() and (out / "data" / "shard-00000.parquet").exists()  # refused: nothing changed
    assert launcher_main([*base, *share, "run.overwrite=true"]) == 0
    assert not first.exists() and not (out / "data").exists()
    assert len(list((out / "runs").glob("*.json"))) == 1


RANK_LINES = {
    2: [
        "[rank2] 12:00:00 INFO meshgen.shards: shard 0 done: 2 images in 0.1 s",
        "[rank2] 12:00:00 INFO launcher.worker.runner: a routine line",
        "[rank2] 12:00:01 WARNING launcher.worker.runner: our warning",
        "[rank2] 12:00:01 WARNING diffusers.models: a library's warning",
        "  a continuation line",
    ],
    0: ["[rank0] 12:00:00 INFO meshgen.stage: loading transformer", "[rank0] 12:00:02 ERROR jobs.edit: our error"],
}


@pytest.mark.parametrize("verbose", [False, True])
def test_worker_logs_go_to_a_file_per_rank_and_the_terminal_gets_shard_events_warnings_and_stages(
    verbose, tmp_path, capsys, monkeypatch
):
    """The terminal (launcher/host/terminal.py's words): by default one line per shard event and our workers'
    warnings and errors, rank 0's stage lines on the bar (never printed), and with MESHGEN_VERBOSE=1 every line of
    every rank, stdout's with its rank; the files, logs/<run id>/rank-N.log and rank-N.stdout.log, hold
    everything."""
    from launcher.host import terminal
    from launcher.ledger.store import Store
    from launcher.logs import RANK_LOGS_ENV

    stages: list[str] = []
    monkeypatch.setattr(terminal, "stage_listeners", [stages.append])
    out = tmp_path / "out"
    with terminal.WorkerLogs(Store(str(out)), "run-1", verbose=verbose) as logs:
        assert os.environ[RANK_LOGS_ENV] == "1"
        envs = {0: {"RANK": "2"}, 1: {"RANK": "0"}}
        dest = logs.specs.reify(envs)
        assert envs[0]["TORCHELASTIC_ERROR_FILE"] == str(out / "logs" / "run-1" / "rank-2.error.json")
        # The files exist before any worker writes: a tailer stopped right after the last line still reads it.
        assert all(Path(f).exists() for f in [*dest.stderrs.values(), *dest.stdouts.values()])
        capsys.readouterr()  # the launcher's own lines so far; cleared before the workers write, since the tailers
        # print what they read at any moment after (cleared after, a line already tailed was lost: seen in a clone)
        for local, rank in ((0, 2), (1, 0)):
            Path(dest.stderrs[local]).write_text("".join(f"{line}\n" for line in RANK_LINES[rank]))
            Path(dest.stdouts[local]).write_text(f"printed by rank {rank}\n")
    assert RANK_LOGS_ENV not in os.environ and logs.rank_log(3) == f"{out}/logs/run-1/rank-3.log"
    shown = capsys.readouterr().err.splitlines()
    if verbose:
        expected = [*RANK_LINES[2], *RANK_LINES[0][1:], "[rank2] printed by rank 2", "[rank0] printed by rank 0"]
    else:
        expected = [RANK_LINES[2][0], RANK_LINES[2][2], RANK_LINES[0][1]]
    assert sorted(shown) == sorted(expected)
    assert stages == ["loading transformer"]
    files = {p.name: p.read_text() for p in (out / "logs" / "run-1").iterdir()}
    assert files["rank-2.log"].splitlines() == RANK_LINES[2] and files["rank-0.stdout.log"] == "printed by rank 0\n"


def test_worker_logs_of_a_bucket_are_written_here_and_uploaded_at_the_end(s3, caplog):
    from launcher.host.terminal import WorkerLogs
    from launcher.ledger.store import Store

    s3_store = Store("s3://meshgen-test/run")

    with WorkerLogs(s3_store, "run-2", verbose=False) as logs:
        local = logs.folder
        dest = logs.specs.reify({0: {"RANK": "1"}})
        Path(dest.stderrs[0]).write_text("a line\n")
    assert logs.rank_log(1) == f"{s3_store.url('logs/run-2')}/rank-1.log"
    assert s3_store.read_bytes("logs/run-2/rank-1.log") == b"a line\n" and not local.exists()
    # An upload that fails keeps the only copy, and says where it is.
    broken = Store("s3://meshgen-test/run")
    broken.write_bytes = lambda rel, data: (_ for _ in ()).throw(OSError("the bucket refused it"))
    with pytest.raises(OSError, match="refused"), WorkerLogs(broken, "run-3", verbose=False) as logs:
        Path(logs.specs.reify({0: {"RANK": "0"}}).stderrs[0]).write_text("the last line\n")
    assert (logs.folder / "rank-0.log").read_text() == "the last line\n"
    assert f"the worker logs stay in {logs.folder}: their upload to {broken.url('logs/run-3')} failed" in caplog.text
    shutil.rmtree(logs.folder.parent)


@pytest.fixture
def quick_peers(monkeypatch):
    """launcher/host/peers.py with a beat every 20 ms and a host lost after 1.5 s of silence; a free port."""
    import socket

    from launcher.host import peers

    monkeypatch.setattr(peers, "HEARTBEAT_S", 0.02)
    monkeypatch.setattr(peers, "LOST_AFTER_S", 1.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return peers, s.getsockname()[1]


def test_hosts_watch_each_others_beat_and_one_that_falls_silent_is_lost(quick_peers):
    """peers.py's words: each launcher increments `meshgen/peer/<node>/beat` in the first host's store; a host whose
    counter stops changing for LOST_AFTER_S is lost; one that said `bye` first is not."""
    peers, port = quick_peers
    with peers.PeerWatch(0, 3, "127.0.0.1", port) as first:
        second, third = peers.PeerWatch(1, 3, "127.0.0.1", port), peers.PeerWatch(2, 3, "127.0.0.1", port)
        second.__enter__(), third.__enter__()
        until(lambda: {1, 2} <= set(first._seen) and {0, 2} <= set(second._seen))
        assert first._store.add(peers.key(1, "beat"), 0) > 0
        third.__exit__(None, None, None)  # ends: says bye
        until(lambda: 2 in first._said_bye and 2 in second._said_bye)
        assert first._store.get(peers.key(2, "bye")) == b"1" and 2 not in first._seen
        assert first.settle() is None and first.lost is None  # the others beat on, or said bye: a failure of ours
        second._closing.set()  # the second host dies: no bye, its beat stops
        until(lambda: first.lost is not None, timeout_s=5 * peers.LOST_AFTER_S)  # lost within LOST_AFTER_S
        assert first.lost == "host 1 (node rank 1) stopped answering"
        assert first.settle() == first.lost


def test_a_host_loses_a_first_host_that_never_serves_or_stops_answering(quick_peers, monkeypatch):
    peers, port = quick_peers
    monkeypatch.setattr(peers, "CONNECT_FOR_S", 0.3)
    with peers.PeerWatch(1, 2, "127.0.0.1", port) as alone:
        until(lambda: alone.lost is not None)
    assert alone.lost == f"the first host's store (127.0.0.1:{port}) never answered"
    monkeypatch.setattr(peers, "CONNECT_FOR_S", 60.0)
    first = peers.PeerWatch(0, 2, "127.0.0.1", port).__enter__()
    with peers.PeerWatch(1, 2, "127.0.0.1", port) as second:
        until(lambda: 0 in second._seen)
        first._closing.set()
        first._server = None  # the first host's launcher is gone, and its store with it
        until(lambda: second.lost is not None)
    assert second.lost.startswith(f"the first host (127.0.0.1:{port}) stopped answering (")


def agree_all(jobs: list[dict]) -> list[str | None]:
    """Every host's agree() at once over one in-memory store: each host's error line, or None."""
    import threading

    from torch.distributed import HashStore

    from launcher.host.agreement import agree

    store, said = HashStore(), [None] * len(jobs)

    def host(node: int) -> None:
        try:
            agree(store, node, len(jobs), jobs[node])
        except ConfigError as e:
            said[node] = str(e)

    threads = [threading.Thread(target=host, args=(n,)) for n in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return said


def test_hosts_with_the_same_job_agree_and_any_difference_is_the_same_line_on_every_host():
    """agreement.py's words: each host's job compared with host 0's, every difference named (theirs != host 0's,
    "(none)" where a key is missing, a value past 40 characters cut to 12 and "..."), at most 8 and "and N more"."""
    job = {"generate.seed": 1, "model.weights.transformer": "sha256:" + "a" * 64, "mesh.tp": 2}
    assert agree_all([job, dict(job), dict(job)]) == [None, None, None]
    other = {**job, "generate.seed": 2, "model.weights.transformer": "sha256:" + "b" * 64, "extra": [1]}
    del other["mesh.tp"]
    line = (
        "host 2's settings differ from host 0's: generate.seed 2 != 1, model.weights.transformer sha256:bbbbb... != "
        "sha256:aaaaa..., mesh.tp (none) != 2, extra [1] != (none); start every host with the same job"
    )
    assert agree_all([job, dict(job), other]) == [line] * 3
    many = {f"k{i}": i + 1 for i in range(10)}
    [said, _] = agree_all([many, {k: -v for k, v in many.items()}])
    assert said.endswith("k7 -8 != 8 and 2 more; start every host with the same job") and "k8" not in said


def test_a_host_that_never_joins_is_one_line_naming_it(monkeypatch):
    from torch.distributed import HashStore

    from launcher.host import agreement

    monkeypatch.setattr(agreement, "CONNECT_FOR_S", 0.3)
    with pytest.raises(ConfigError) as e:
        agreement.agree(HashStore(), 0, 3, {"generate.seed": 1})
    assert str(e.value) == (
        "hosts [1, 2] of this job (mesh.nodes=3) never joined within 0 s; start every host with the same job, "
        "MASTER_ADDR and MASTER_PORT"
    )


def test_the_job_the_hosts_compare_is_the_fingerprint_the_mesh_and_versions_but_not_this_hosts_own_keys():
    from launcher.config import load_config
    from launcher.host.agreement import job_of

    cfg = load_config("tiny", ["generate.seed=9", "output.metrics=/tmp/m.prom", "run.overwrite=true"])
    job = job_of(cfg)
    assert job["generate.seed"] == 9 and job["mesh.tp"] == 2 and job["mesh.dp"] == 1
    assert {"versions.torch", "versions.diffusers", "config.output.dir", "config.dataset.path"} <= set(job)
    assert not {"config.output.metrics", "config.output.publish", "config.run.overwrite"} & set(job)
    assert job_of(load_config("tiny", ["generate.seed=9"])) == job  # this host's own keys change nothing


def test_stale_shards_kept_by_run_stale_keep_are_recorded_so_the_same_command_without_it_finds_them_done(
    launcher_main, tiny_model, tmp_path, capsys
):
    """DESIGN: `run.stale=keep` is recorded for the samples it kept: the same command without it then exits 0. A
    done shard whose prompts changed (its state's prompts_fingerprint is another's) is stale; with nothing selected
    (`run.shards=failed`) no worker starts."""
    out = tmp_path / "out"
    base = ["conf=tiny", f"model.path={tiny_model}", f"output.dir={out}", "run.shards=failed"]
    assert launcher_main(base) == 0, capsys.readouterr().err[-2000:]
    (out / "state").mkdir()
    done = {"status": "done", "rows": 8, "prompts_fingerprint": "of-other-prompts", "files": {}}
    (out / "state" / "shard-00001.json").write_text(json.dumps(done))
    assert launcher_main(base) == 2  # run.stale=error, the default: refused
    assert "shard" in capsys.readouterr().err.strip().splitlines()[-1]
    assert launcher_main([*base, "run.stale=keep"]) == 0
    said = capsys.readouterr().err
    assert "WARNING launcher.host.launch: keeping shards [1] as they are although their prompts changed" in said
    kept = json.loads((out / "state" / "shard-00001.json").read_text())
    assert kept["prompts_fingerprint"] == "of-other-prompts" and len(kept) == len(done) + 1  # the kept mark added
    assert launcher_main(base) == 0, capsys.readouterr().err[-2000:]


def test_a_shard_that_failed_max_attempts_times_is_held_and_the_last_line_says_how_to_retry_it(
    launcher_main, tiny_model, tmp_path, capsys
):
    """DESIGN: a shard that failed run.max_attempts times with the same error (default 3) is not retried by the same
    command; `run.shards=failed` retries it. One shard of 3 prompts, failed 3 times: the run starts no worker,
    ends 3 (a selected shard is not done) and names the shard, its error and the command that retries it."""
    prompts, out = tmp_path / "p.txt", tmp_path / "out"
    prompts.write_text("a\nb\nc\n")
    base = ["conf=tiny", f"model.path={tiny_model}", f"output.dir={out}", f"dataset.path={prompts}"]
    assert launcher_main([*base, "run.shards=failed"]) == 0, capsys.readouterr().err[-2000:]
    (out / "state").mkdir()
    failed = {"status": "failed", "attempts": 3, "error_class": "ValueError", "error": "boom " * 50}
    (out / "state" / "shard-00000.json").write_text(json.dumps(failed | {"samples": ["0", "1", "2", "3", "4", "5"]}))
    assert launcher_main(base) == 3
    from launcher.config import REPO_ROOT

    rerun = f"{REPO_ROOT / 'launch.sh'} conf=tiny model.path={tiny_model} output.dir={out} dataset.path={prompts}"
    assert (
        "not retried: shards [0] failed 3 times in a row with the same error (shard 0: ValueError at samples '0', "
        f"'1', '2', '3', '4': {('boom ' * 50)[:200]}); a rerun fails them again: fix the row(s), then run {rerun} "
        "run.shards=failed"
    ) in capsys.readouterr().err


def test_an_object_store_output_is_checked_by_its_bucket_and_a_missing_one_is_one_line(store_env, monkeypatch):
    """launcher/checks/settings.py: an s3:// or gs:// output.dir's bucket must answer (nothing is written); a missing
    bucket or an unknown scheme is one line naming output.dir and what to check."""
    from launcher.checks.settings import check_object_store

    scheme, env = store_env
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    url_scheme = "s3" if scheme == "s3" else "gs"
    check_object_store(f"{url_scheme}://meshgen-test/runs/a")  # the local server's bucket: fine
    with pytest.raises(ConfigError) as e:
        check_object_store(f"{url_scheme}://no-such-bucket-here/x")
    assert str(e.value).startswith(f"output.dir={url_scheme}://no-such-bucket-here/x cannot be reached (")
    assert str(e.value).endswith("STORAGE_EMULATOR_HOST for a local GCS server)")
    with pytest.raises(
        ConfigError, match=r"^output.dir=ftp://b/x: unknown scheme ftp://; use a local path, gs:// or s3://$"
    ):
        check_object_store("ftp://b/x")


def test_the_first_host_refuses_a_rendezvous_port_another_program_holds(monkeypatch):
    """DESIGN-level behaviour of a multi-host job: host 0 serves the store on MASTER_PORT; a port in use is one line
    before anything starts; other hosts do not bind it."""
    import socket

    from launcher.checks.settings import check_store_port

    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        check_store_port(1)  # not the first host: nothing to bind
        with pytest.raises(ConfigError) as e:
            check_store_port(0)
    assert str(e.value) == (
        f"MASTER_PORT {port} cannot be bound on this host (Address already in use); another program holds it: "
        "pick a free port and set MASTER_PORT to it on every host"
    )
    check_store_port(0)  # free again


def online(monkeypatch) -> None:
    """No HF_HUB_OFFLINE for this test, and none after it: the checks set it where a whole pipeline is cached, and a
    bare delenv of a variable that is not set would leave theirs to the tests after."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # recorded: the variable is restored (or removed) at the end
    monkeypatch.delenv("HF_HUB_OFFLINE")


# --- The preflight's downloads (checks/download.py, checks/quality_models.py) against the fake Hub in this process.

REPO, GATED = "meshgen-test/tiny-flux2", "meshgen-test/gated-flux2"


@pytest.fixture
def model_hub(tiny_model, empty_cache, monkeypatch):
    """The fake Hub (tests/fake_hub.py) serving the tiny pipeline plus a single-file checkpoint it does not load,
    a gated copy, and two quality-model repos (one with both weight formats, one with its PyTorch pickle only); this
    process's huggingface_hub pointed at it with an empty cache, no token, a 2 s wait."""
    from fake_hub import FakeHub, Repo, serve
    from huggingface_hub import constants, hf_api

    hub = FakeHub()
    hub.add_folder(REPO, tiny_model, extra={"all-in-one.safetensors": b"\0" * 1024})
    hub.add_folder(GATED, tiny_model, gated=True)
    for name, weights in (("clip", ("model.safetensors", "pytorch_model.bin")), ("old", ("pytorch_model.bin",))):
        files = {"config.json": b"{}", "vocab.txt": b"a", "README.md": b"#", "tf_model.h5": b"h"}
        files |= dict.fromkeys(weights, b"w")  # the clip repo has both formats: only its safetensors are wanted
        hub.repos[f"org/{name}"] = Repo(files)
    server = serve(hub)
    template = constants.HUGGINGFACE_CO_URL_TEMPLATE.replace(constants.ENDPOINT, hub.url, 1)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)  # file URLs: set at import
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(hf_api.api, "endpoint", hub.url)  # the module's HfApi, which diffusers' download asks
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 2)
    monkeypatch.setenv("HF_TOKEN", "")
    yield hub
    server.shutdown()


def fetched(hub, repo: str) -> list[str]:
    return sorted(p.split("/resolve/", 1)[1].split("/", 1)[1] for p in hub.requested("GET") if f"/{repo}/resolve/" in p)


def test_a_hub_id_is_fetched_once_with_the_files_its_pipeline_loads_and_a_complete_cache_asks_nothing(
    model_hub, tiny_model, tmp_path, monkeypatch
):
    """download.py's words: only what the pipeline loads (not the repo's single-file checkpoints), model_index.json
    first; a complete cache, a folder, a path that is no hub id, or HF_HUB_OFFLINE=1: no request at all."""
    from launcher.checks.download import ensure_downloaded

    ensure_downloaded(REPO)
    wanted = sorted(str(p.relative_to(tiny_model)) for p in tiny_model.rglob("*") if p.is_file())
    got = fetched(model_hub, REPO)
    assert set(got) <= set(wanted) and len(got) == len(set(got)), got  # nothing else, each file once
    assert {w for w in wanted if w.endswith((".safetensors", "/config.json"))} <= set(got)  # every weight, config
    gets = model_hub.requested("GET")
    first = next(i for i, p in enumerate(gets) if "/resolve/" in p)
    assert gets[first].endswith("/model_index.json") and f"/api/models/{REPO}" in gets[:first]  # info, then it
    snapshot = next((tmp_path / "hf-cache").glob("models--meshgen-test--tiny-flux2/snapshots/*"))
    assert (snapshot / "vae" / "diffusion_pytorch_model.safetensors").is_file()
    before = len(model_hub.log)
    ensure_downloaded(REPO)  # complete: nothing asked
    ensure_downloaded(str(tiny_model))  # a folder
    ensure_downloaded("some/local/path")  # three parts: a path, not a hub id
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ensure_downloaded("meshgen-test/not-cached")
    assert model_hub.log[before:] == []


def test_a_pipeline_whole_in_the_cache_makes_the_workers_run_offline(model_hub, monkeypatch):
    """model_checks.py: once the whole pipeline is in the cache (checked), HF_HUB_OFFLINE=1 for the workers: each
    rank would otherwise ask the hub for updates, and hang where it cannot be reached."""
    from launcher.checks.download import ensure_downloaded
    from launcher.checks.model_checks import check_model, locate
    from launcher.config import load_config

    online(monkeypatch)
    ensure_downloaded(REPO)
    cfg = load_config("tiny", [f"model.path={REPO}", "model.build=null", "mesh.tp=1", "mesh.dp=1"])
    assert "HF_HUB_OFFLINE" not in os.environ
    check_model(cfg, locate(cfg))
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_a_gated_or_unknown_hub_id_is_one_line_and_nothing_is_fetched(model_hub):
    from launcher.checks.download import ensure_downloaded

    url = model_hub.url
    with pytest.raises(ConfigError) as e:
        ensure_downloaded(GATED)
    assert str(e.value) == (
        f"model.path {GATED} is a gated repo: log in (hf auth login, or set HF_TOKEN) with an account that "
        f"accepted its license at {url}/{GATED}"
    )
    with pytest.raises(ConfigError) as e:
        ensure_downloaded("meshgen-test/no-such-model")
    assert str(e.value) == (
        f"model.path meshgen-test/no-such-model is not a repo on {url} (or a private one: log in with "
        "hf auth login); check the id, or point model.path at a local folder"
    )
    assert not any(p.endswith(".safetensors") for p in model_hub.requested("GET"))


def test_a_hub_that_never_answers_is_one_line_within_its_wait_and_a_busy_one_is_left_to_the_download(
    silent_hub, monkeypatch
):
    """hub_answers' words: no HTTP answer within HF_HUB_ETAG_TIMEOUT is one line naming the wait; an HTTP answer is
    an answer: 429 and 5xx are left to the caller's retrying download, any other error raised to the caller."""
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError

    from launcher.checks.download import ensure_downloaded, hub_answers

    url, paths = silent_hub
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)
    online(monkeypatch)
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        hub_answers("org/m", "quality.clip_model")
    assert time.monotonic() - start < 30 and "/api/models/org/m" in paths  # (and whatever else the library asks)
    assert str(e.value) == (
        f"quality.clip_model org/m: the hub at {url} did not answer within 1 s (ReadTimeout); check the network and "
        "HF_ENDPOINT (HF_HUB_ETAG_TIMEOUT sets the wait), or download it elsewhere (hf download org/m) into HF_HOME"
    )
    with pytest.raises(ConfigError) as e:  # through the model's download: named as the key it came from
        ensure_downloaded("org/m")
    assert str(e.value).startswith(f"model.path org/m: the hub at {url} did not answer within 1 s (")
    codes = []

    class Busy(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(codes[0])
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    Thread(target=server.serve_forever, daemon=True).start()
    busy = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setattr(constants, "ENDPOINT", busy)
    try:
        for code in (429, 500, 503):
            codes[:] = [code]
            hub_answers("org/m", "model.path")  # left to the download's retries
        codes[:] = [403]
        with pytest.raises(HfHubHTTPError):
            hub_answers("org/m", "model.path")
        # A hub that answers the info but not a file: the download's own failure, as one line.
        codes[:] = [400]
        monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)
        with pytest.raises(ConfigError) as e:
            ensure_downloaded("org/m")
        line = str(e.value)
        assert line.startswith(f"cannot download model.path org/m from {busy} (") and "\n" not in line
        assert line.endswith("); check the network, or download it elsewhere (hf download org/m) into HF_HOME")
    finally:
        server.shutdown()


def test_quality_models_are_fetched_once_with_only_what_from_pretrained_loads(model_hub, tmp_path, monkeypatch):
    """quality_models.py's words: configs, tokenizer files and safetensors weights; an older repo's PyTorch pickle
    where it has no safetensors; only for the scores that are on; a repo that cannot be downloaded is one line."""
    from launcher.checks.quality_models import fetch_quality_models

    q = {"clip_score": True, "clip_model": "org/clip", "safety": False, "safety_model": "org/old"}
    fetch_quality_models(OmegaConf.create({"quality": q}))
    assert fetched(model_hub, "org/clip") == ["config.json", "model.safetensors", "vocab.txt"]
    assert fetched(model_hub, "org/old") == []  # safety is off
    fetch_quality_models(OmegaConf.create({"quality": q | {"clip_score": False, "safety": True}}))
    assert fetched(model_hub, "org/old") == ["config.json", "pytorch_model.bin", "vocab.txt"]
    fetch_quality_models(OmegaConf.create({"quality": q | {"clip_model": str(tmp_path)}}))  # a folder: nothing
    with pytest.raises(ConfigError) as e:
        fetch_quality_models(OmegaConf.create({"quality": q | {"clip_model": "org/none"}}))
    line = str(e.value)
    assert line.startswith("quality.clip_model=org/none cannot be downloaded (401 Client Error") and "\n" not in line
    assert line.endswith("); check the id and your HF_TOKEN") and len(line) <= len(line.split(" (", 1)[0]) + 240
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: from_pretrained says what is missing, nothing is asked
    before = len(model_hub.log)
    fetch_quality_models(OmegaConf.create({"quality": q | {"clip_model": "org/other"}}))
    assert model_hub.log[before:] == []


# --- The model checks (checks/model_checks.py) over the published configs and a local pipeline folder.

FLUX2_DEV = "black-forest-labs/FLUX.2-dev"


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """No hub id is in this process's Hugging Face cache, and the network may be used."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    online(monkeypatch)


def refusal(check, conf: str, *overrides: str) -> str | None:
    """`check(cfg, model)`'s line for the job (its model located as the preflight locates it), or None."""
    from launcher.checks.model_checks import locate
    from launcher.config import load_config

    cfg = load_config(conf, list(overrides))
    try:
        check(cfg, locate(cfg))
    except ConfigError as e:
        return str(e)
    return None


def model_refusal(conf: str, *overrides: str) -> str | None:
    from launcher.checks.model_checks import check_model

    return refusal(check_model, conf, *overrides)


def test_tp_must_divide_the_heads_of_each_sharded_model_of_flux2_dev(empty_cache):
    """FLUX.2-dev's published configs (checkpoints.py): a transformer of 48 heads, a Mistral text encoder of 32
    query and 8 key-value heads; only a sharded model's heads bound mesh.tp."""
    assert model_refusal("flux2_tp", "mesh.tp=8") is None
    assert model_refusal("flux2_tp", "mesh.tp=16") == (
        "mesh.tp=16 does not divide the text encoder's num_key_value_heads=8; use a tp that divides 8"
    )
    assert model_refusal("flux2_tp", "mesh.tp=16", "model.shard_text_encoder=false") is None
    assert model_refusal("flux2_tp", "mesh.tp=3") == (
        "mesh.tp=3 does not divide the text encoder's num_attention_heads=32; use a tp that divides 32"
    )
    assert model_refusal("flux2_tp", "mesh.tp=5", "model.shard_text_encoder=false") == (
        "mesh.tp=5 does not divide the transformer's num_attention_heads=48; use a tp that divides 48"
    )
    off = ("model.shard_text_encoder=false", "model.shard_transformer=false")
    assert model_refusal("flux2_tp", "mesh.tp=5", *off) == (
        "mesh.tp=5 shards nothing: model.shard_transformer is false and model.shard_text_encoder is false; "
        "use mesh.tp=1 and mesh.dp for more chips"
    )
    assert model_refusal("sd35_medium", "mesh.tp=2", "mesh.dp=1") == (  # SD3's encoders: CLIP and T5, no plan
        "mesh.tp=2 shards nothing: model.shard_transformer is false and model.shard_text_encoder cannot be: "
        "StableDiffusion3Pipeline has no tensor-parallel plan for it; use mesh.tp=1 and mesh.dp for more chips"
    )
    assert model_refusal("flux2_tp", "mesh.tp=5", "model.shard_transformer=false") == (
        "mesh.tp=5 does not divide the text encoder's num_attention_heads=32; use a tp that divides 32"
    )


def test_sizes_are_multiples_of_the_vae_scale_times_the_patch_and_at_most_4_megapixels(empty_cache):
    """FLUX.2's VAE has 4 levels (scale 8) and its latents are packed 2x2, so sizes are multiples of 16; every
    family allows at most 4 * 2**20 pixels (DESIGN's bound), that many exactly included."""
    assert model_refusal("flux2_tp", "generate.height=1000") == (
        "generate.height=1000 is not a multiple of 16 (VAE scale factor x patch size for this model); use e.g. 992"
    )
    assert model_refusal("flux2_tp", "generate.width=8") == (
        "generate.width=8 is not a multiple of 16 (VAE scale factor x patch size for this model); use e.g. 16"
    )
    assert model_refusal("flux2_tp", "generate.height=2048", "generate.width=2048") is None
    assert model_refusal("flux2_tp", "generate.height=2048", "generate.width=2064") == (
        "generate.height x generate.width = 2048x2064 is more than the 4.0 megapixels this model family allows; "
        "use a smaller size"
    )


@pytest.mark.parametrize(
    ("conf", "hub_id", "what", "multiple"),
    [
        ("sd35_medium", "stabilityai/stable-diffusion-3.5-medium", "StableDiffusion3Pipeline", 16),  # 8 x patch 2
        ("qwenimage_tp", "Qwen/Qwen-Image", "QwenImagePipeline", 16),  # 3 temporal downsamplings: 8, packed 2x2
        ("flux1_schnell", "black-forest-labs/FLUX.1-schnell", "FluxPipeline", 16),
    ],
)
def test_a_published_model_not_yet_downloaded_is_known_by_its_configs(empty_cache, conf, hub_id, what, multiple):
    from launcher.checks.model_checks import locate, size_multiple
    from launcher.config import load_config

    model = locate(load_config(conf, [f"model.path={hub_id}"]))
    assert (model.path, model.root, model.what) == (hub_id, None, what) and model.family is not None
    assert "transformer" in model.configs and "vae" in model.configs
    assert size_multiple(model) == multiple


def test_a_model_path_that_cannot_be_found_is_one_line_and_an_unknown_hub_id_is_checked_after_its_download(
    empty_cache, tmp_path, monkeypatch
):
    from launcher.checks.model_checks import locate
    from launcher.config import load_config

    gone = tmp_path / "no" / "model"
    assert model_refusal("tiny", f"model.path={gone}", "model.build=null") == (
        f"model.path {gone} does not exist; point it at a diffusers pipeline folder or a hub id"
    )
    assert model_refusal("tiny", f"model.path={tmp_path}", "model.build=null") == (
        f"model.path {tmp_path} is not a diffusers pipeline (no model_index.json in {tmp_path}); "
        "point it at the pipeline's top folder"
    )
    # An id the table does not know: nothing is known before its download, so nothing is refused yet.
    assert model_refusal("flux2_tp", "model.path=org/unknown", "mesh.tp=7", "generate.height=1000") is None
    model = locate(load_config("tiny", ["model.path=org/unknown", "model.build=null"]))
    assert (model.root, model.family, model.what, model.configs) == (None, None, "this pipeline", None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the run could not download it either
    assert model_refusal("flux2_tp", f"model.path={FLUX2_DEV}") == (
        f"model.path {FLUX2_DEV} is neither a local folder nor in the Hugging Face cache; download it first "
        f"(hf download {FLUX2_DEV}) or set model.path to a local folder"
    )


def test_a_pipeline_folder_is_read_from_its_configs_and_its_vae_sets_the_size_multiple(tiny_model, monkeypatch):
    """_configs' words: each component of model_index.json as (library, class, its config.json)."""
    from launcher.checks.model_checks import locate, size_multiple
    from launcher.config import load_config

    online(monkeypatch)
    model = locate(load_config("tiny", [f"model.path={tiny_model}"]))
    index = json.loads((tiny_model / "model_index.json").read_text())
    assert (model.root, model.what) == (tiny_model, index["_class_name"])
    parts = {k for k, v in index.items() if isinstance(v, list) and v[0] and (tiny_model / k / "config.json").is_file()}
    assert set(model.configs) == parts and "scheduler" not in parts
    for part in parts:
        config = json.loads((tiny_model / part / "config.json").read_text())
        assert model.configs[part] == (index[part][0], index[part][1], config)
    levels = len(json.loads((tiny_model / "vae" / "config.json").read_text())["block_out_channels"])
    assert size_multiple(model) == 2 ** (levels - 1) * 2
    assert "HF_HUB_OFFLINE" not in os.environ  # a folder: workers never ask a hub


# --- The LoRA checks (checks/lora_checks.py), in this process over the tiny model's LoRAs (tests/test_lora.py).
loras = test_lora.loras


def lora_cfg(model: Path, *files_scales: tuple[Path, float]):
    from launcher.config import load_config

    entries = ",".join(f"{{path:{f},scale:{s}}}" for f, s in files_scales)
    return load_config("tiny", [f"model.path={model}", f"model.loras=[{entries}]"])


def test_a_lora_with_non_finite_values_is_refused_naming_its_first_tensor_and_the_files_count(loras, tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from launcher.checks.lora_checks import check_loras

    model, files = loras("flux2")
    sd = load_file(str(files[0]))
    keys = list(sd)
    sd[keys[1]][0, :2] = float("nan")  # 2 here, then 1 inf in a later tensor: 3 in the file
    sd[keys[3]][0, 0] = float("inf")
    bad = tmp_path / "nan.safetensors"
    save_file(sd, str(bad))
    with safe_open(str(bad), "pt") as f:
        first = next(k for k in f.keys() if k in (keys[1], keys[3]))  # the file's order, not the dict's
    with pytest.raises(ConfigError) as e:
        check_loras(lora_cfg(model, (files[0], 1.0), (bad, 0.5)), model)
    n = 2 if first == keys[1] else 1
    assert str(e.value) == (
        f"model.loras[1] {bad}: tensor {first!r} holds {n} non-finite values (NaN or inf; 3 in the file), which "
        "would make every image black; use a sound checkpoint of the LoRA"
    )
    assert torch.isfinite(load_file(str(files[0]))[keys[1]]).all()  # the fixture's own file is untouched


def test_a_file_that_is_not_a_lora_is_one_line_with_the_readers_first_line(loras, tmp_path, monkeypatch):
    """The reader's error, its first line cut at 200 characters, or its type where it says nothing."""
    from launcher.checks import lora_checks
    from launcher.worker import lora

    model, files = loras("flux2")
    short = tmp_path / "short.safetensors"
    short.write_bytes(files[0].read_bytes()[:100])  # truncated: safetensors' own error
    with pytest.raises(ConfigError) as e:
        lora_checks.check_loras(lora_cfg(model, (short, 1.0)), model)
    line = str(e.value)
    assert line.startswith(f"model.loras[0] {short} cannot be read as a LoRA (") and line.endswith(")")
    assert "\n" not in line and len(line) > len(f"model.loras[0] {short} cannot be read as a LoRA ()")
    for message, shown in (("x" * 300 + "\nsecond", "x" * 200), ("", "RuntimeError"), ("first\nsecond", "first")):

        def fail(file, message=message):
            raise RuntimeError(message)

        monkeypatch.setattr(lora, "non_finite", fail)
        with pytest.raises(ConfigError) as e:
            lora_checks.check_loras(lora_cfg(model, (files[0], 1.0)), model)
        assert str(e.value) == f"model.loras[0] {files[0]} cannot be read as a LoRA ({shown})"
    monkeypatch.undo()
    for message, shown in (("y" * 300, "y" * 200), ("", "KeyError"), ("one\ntwo", "one")):

        def unreadable(cls, file, path, message=message):
            raise (KeyError() if not message else OSError(message))

        monkeypatch.setattr(lora, "factors", unreadable)
        with pytest.raises(ConfigError) as e:
            lora_checks.check_loras(lora_cfg(model, (files[1], 1.0)), model)
        assert str(e.value) == f"model.loras[0] {files[1]} cannot be read as a LoRA ({shown})"


def test_each_sound_lora_is_logged_with_the_layers_it_changes_per_component(loras, caplog):
    """One line per LoRA: its index, file name, scale and how many layers of each component its keys name."""
    from safetensors import safe_open

    from launcher.checks.lora_checks import check_loras

    model, files = loras("flux2")
    with caplog.at_level("INFO", logger="launcher.checks.lora_checks"):
        check_loras(lora_cfg(model, (files[0], 0.5), (files[1], 1.25)), model)
    lines = [r.getMessage() for r in caplog.records if r.name == "launcher.checks.lora_checks"]
    expected = []
    for i, (f, s) in enumerate(((files[0], 0.5), (files[1], 1.25))):
        with safe_open(str(f), "pt") as t:
            layers = {}
            for k in t.keys():
                if ".lora_A." in k:
                    part, module = k.split(".", 1)
                    layers.setdefault(part, set()).add(module.split(".lora_A.")[0])
        counts = ", ".join(f"{len(m)} {c} layers" for c, m in layers.items())
        expected.append(f"LoRA {i} ({f.name}, scale {s}): {counts}")
    assert lines == expected


FAMILY_REFUSED = {  # (conf, overrides): check_model's line, over the published configs of the recipes' models
    ("sd35_medium", "job=edit"): "job=edit: StableDiffusion3Pipeline does not take reference images (family sd3); "
    "use a model that edits (families: flux2, flux2_klein, qwenimage_edit) or job=text_to_image",
    ("sd35_medium", "execution.mode=compile", "execution.offload=model"): "execution.mode=compile with "
    "execution.offload=model compiles the transformer's repeated blocks, which StableDiffusion3Pipeline does not "
    "define; use execution.offload=none (whole-transformer compile) or execution.mode=eager",
    ("sd35_medium", "mesh.tp=2", "model.shard_transformer=true"): "mesh.tp=2: StableDiffusion3Pipeline has no "
    "tensor-parallel plan for its transformer; use mesh.tp=1 (and mesh.dp for more chips), or "
    "model.shard_transformer=false",
    ("flux1_schnell", "mesh.tp=2", "model.shard_transformer=false"): "mesh.tp=2 shards nothing: "
    "model.shard_transformer is false and model.shard_text_encoder cannot be: FluxPipeline has no tensor-parallel "
    "plan for it; use mesh.tp=1 and mesh.dp for more chips",
    ("sd35_medium", "execution.staged=true"): "execution.staged=true is not supported for this model (family sd3 "
    "declares no separate prompt encoding); use execution.staged=false",
    ("flux1_schnell", "execution.cache=taylorseer"): "execution.cache=taylorseer is not supported for this model "
    "(family flux1; supported: none); use execution.cache=none or one of those",
    ("flux2_tp", "execution.cache=first_block"): "execution.cache=first_block is not supported for this model "
    "(family flux2; supported: taylorseer, magcache); use execution.cache=none or one of those",
}
FAMILY_PASSED = [  # each refusal's nearest job that is sound
    ("sd35_medium", "job=text_to_image"),
    ("flux2_tp", "job=edit"),
    ("sd35_medium", "execution.mode=eager", "execution.offload=model"),
    ("flux1_schnell", "execution.mode=compile", "execution.offload=model"),  # the FLUX.1 recipe: repeated blocks
    ("flux1_schnell", "mesh.tp=2", "model.shard_transformer=true"),
    ("flux2_tp", "execution.staged=true"),
    ("flux2_tp", "execution.cache=taylorseer"),
    # MagCache's ratios are given per model; its steps come from generate.num_inference_steps (5 ratios, 28 steps)
    ("flux2_tp", "execution.cache=magcache", "+execution.cache_options.mag_ratios=[1.0,1.0,1.0,1.0,1.0]"),
]


@pytest.mark.parametrize("job", FAMILY_REFUSED)
def test_each_family_limit_is_one_line_naming_the_pipeline_or_family(empty_cache, job):
    assert model_refusal(*job) == FAMILY_REFUSED[job]


@pytest.mark.parametrize("job", FAMILY_PASSED)
def test_the_nearest_sound_job_of_each_family_limit_passes(empty_cache, job):
    assert model_refusal(*job) is None


def test_cache_options_diffusers_refuses_are_one_line_with_its_first_line(empty_cache):
    line = model_refusal("flux2_tp", "execution.cache=taylorseer", "+execution.cache_options.bogus=1")
    head = "execution.cache_options={'bogus': 1} are not accepted by diffusers' TaylorSeerCacheConfig ("
    assert line.startswith(head)
    assert "unexpected keyword argument 'bogus'" in line and line.endswith("); fix or remove them")


def sweep_refusal(conf: str, *overrides: str) -> str | None:
    from launcher.checks.sweep_checks import check_sweep_model

    return refusal(check_sweep_model, conf, *overrides)


SWEEP_REFUSED = {  # FLUX.2-dev's sizes are multiples of 16, at most 4 * 2**20 pixels; it has no true CFG
    ("flux2_tp", "generate.sweep={height:[1024,1000]}"): "generate.sweep.height: value 1000 is not a multiple of 16 "
    "(this model's size factor); use e.g. 992",
    ("flux2_tp", "generate.sweep={width:[8]}"): "generate.sweep.width: value 8 is not a multiple of 16 (this "
    "model's size factor); use e.g. 16",
    ("flux2_tp", "generate.height=2048", "generate.sweep={width:[1024,2064]}"): "generate.sweep: 2064x2048 is 4.0 "
    "megapixels, more than the 4.0 this model family allows; use a smaller size",
    ("flux2_tp", "generate.width=2064", "generate.sweep={height:[2048]}"): "generate.sweep: 2064x2048 is 4.0 "
    "megapixels, more than the 4.0 this model family allows; use a smaller size",
    ("flux2_tp", "generate.sweep={true_cfg_scale:[1.5]}"): "generate.sweep.true_cfg_scale: this model's family "
    "(flux2) has no true_cfg_scale apart from guidance_scale; sweep guidance_scale instead",
    ("flux2_tp", "+model.call_kwargs.true_cfg_scale=2.0"): "model.call_kwargs.true_cfg_scale: this model's family "
    "(flux2) has no true_cfg_scale apart from guidance_scale; use generate.guidance_scale",
}
SWEEP_PASSED = [
    ("flux2_tp", "generate.sweep={height:[1024,992],width:[2048,16]}"),  # 2048x2048 at most: 4 * 2**20 exactly
    ("flux2_tp", "generate.height=2048", "generate.sweep={guidance_scale:[1.0,2.0]}"),
    ("flux1_schnell", "generate.sweep={true_cfg_scale:[1.0,1.5]}"),  # FluxPipeline's true CFG
    ("flux1_schnell", "+model.call_kwargs.true_cfg_scale=2.0"),
]


@pytest.mark.parametrize("job", SWEEP_REFUSED)
def test_each_swept_size_and_true_cfg_is_checked_against_the_model(empty_cache, job):
    assert sweep_refusal(*job) == SWEEP_REFUSED[job]


@pytest.mark.parametrize("job", SWEEP_PASSED)
def test_sweeps_the_model_allows_pass(empty_cache, job):
    assert sweep_refusal(*job) is None


# --- The mesh plan (sizing/mesh_plan.py) of FLUX.2-dev, against numbers worked out here by hand.

# FLUX.2-dev's parameters (tests/test_memory_plan.py): transformer 32,223,281,152 of which 31,406,948,352 in sharded
# layers, text encoder 23,340,272,640 of which 22,900,899,840, VAE 84,046,372 (not sharded); bf16: 2 bytes each.
FLUX2_DEV_PARAMS = {"transformer": (32_223_281_152, 31_406_948_352), "text_encoder": (23_340_272_640, 22_900_899_840)}


def flux2_rank_gib(tp: int) -> dict[str, float]:
    out = {k: (total - sharded + sharded / tp) * 2 / GIB for k, (total, sharded) in FLUX2_DEV_PARAMS.items()}
    return out | {"vae": 84_046_372 * 2 / GIB}


def flux2_need_text(tp: int, how: str = "together") -> str:
    """mesh_plan's words: per-rank weights (each part), how they share the chip, + 2 GiB a megapixel of a call."""
    r = flux2_rank_gib(tp)
    on_chip = {"together": sum(r.values()), "staged": max(r["transformer"], r["text_encoder"]) + r["vae"]}[how]
    how = {"together": "together", "staged": "text encoder and transformer in turn (staged)"}[how]
    parts = ", ".join(f"{p} {r[p]:.1f}" for p in ("transformer", "text_encoder", "vae"))
    return f"per-rank weights ({parts} GiB, on the chip {how}) + 2.0 GiB working margin = {on_chip + 2:.1f} GiB"


def flux2_plan(*overrides: str, device: str = "tpu", strict: bool = True):
    from launcher.config import load_config
    from launcher.models.checkpoints import PUBLISHED
    from launcher.sizing.mesh_plan import plan_mesh

    cfg = load_config("flux2_tp", ["dataset.path=/data/p.txt", *overrides])
    return plan_mesh(cfg, device, PUBLISHED["black-forest-labs/FLUX.2-dev"], strict=strict), cfg


def flux2_refusal(*overrides: str, device: str = "tpu") -> str:
    with pytest.raises(ConfigError) as e:
        flux2_plan(*overrides, device=device)
    return str(e.value)


def test_a_mesh_whose_weights_do_not_fit_names_the_smallest_tp_that_does():
    """v6e: 32 GiB, 90% usable (28.8); at tp=2 the weights are 53.1 GiB a rank; tp=4 needs 29.8, tp=8 17.1."""
    usable = "28.8 GiB usable per v6e chip (32 GiB less 10% reserved)"
    assert flux2_refusal("mesh.tp=2", "mesh.dp=4") == (
        f"mesh dp=4 tp=2 does not fit: {flux2_need_text(2)} > {usable}; use mesh.tp=8 or mesh.tp=auto"
    )
    assert flux2_refusal("mesh.tp=2", "mesh.dp=4", "execution.staged=true") == (  # 30.9 + 2 > 28.8; tp=4 fits
        f"mesh dp=4 tp=2 does not fit: {flux2_need_text(2, 'staged')} > {usable}; use mesh.tp=4 or mesh.tp=auto"
    )
    plan, cfg = flux2_plan("mesh.tp=2", "mesh.dp=4", strict=False)  # a dry run for another host: said, not refused
    assert plan.why == [
        f"would be refused: mesh dp=4 tp=2 does not fit: {flux2_need_text(2)} > {usable}; use mesh.tp=8 or mesh.tp=auto"
    ]
    small = "14.4 GiB usable per v6e chip (16 GiB less 10% reserved)"
    assert flux2_refusal("mesh.tp=8", "mesh.dp=1", "mesh.chip_memory_gib=16") == (
        f"mesh dp=1 tp=8 does not fit: {flux2_need_text(8)} > {small}; use more chips (mesh.tp), "
        "execution.offload=model, a smaller generate.batch_size or size"
    )
    plan, _ = flux2_plan("mesh.tp=8", "mesh.dp=1")
    assert (plan.dp, plan.tp, plan.why) == (1, 8, [])
    assert {k: round(v / GIB, 2) for k, v in plan.per_rank.items()} == {
        k: round(v, 2) for k, v in flux2_rank_gib(8).items()
    }


def test_cpu_processes_share_the_hosts_memory():
    """On cpu every process of the host shares its RAM: 8 processes of a 32 GiB host have 3.6 GiB each."""
    line = flux2_refusal(
        "device=cpu", "mesh.chip=cpu", "mesh.chip_memory_gib=32", "mesh.tp=2", "mesh.dp=4", device="cpu"
    )
    assert line == (
        f"mesh dp=4 tp=2 does not fit: {flux2_need_text(2)} > 3.6 GiB usable per cpu chip (32 GiB less 10% "
        "reserved); use more chips (mesh.tp), execution.offload=model, a smaller generate.batch_size or size"
    )


def test_tp_auto_takes_the_smallest_tp_that_fits_and_says_what_the_next_smaller_would_need(monkeypatch):
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    plan, cfg = flux2_plan("mesh.tp=auto", "mesh.dp=1")
    need8, need4 = sum(flux2_rank_gib(8).values()) + 2, sum(flux2_rank_gib(4).values()) + 2
    assert (plan.tp, cfg.mesh.tp) == (8, 8)
    assert plan.why == [
        f"tp=auto chose 8: the smallest tp that divides the sharded heads and fits: {need8:.1f} GiB per rank of "
        f"28.8 GiB usable; tp=4 would need {need4:.1f} GiB"
    ]
    plan, _ = flux2_plan("mesh.tp=auto", "mesh.dp=1", "mesh.chip=h200", "device=cuda", device="cuda")
    assert plan.tp == 1 and plan.why[0].endswith("of 126.9 GiB usable")  # 141 x 0.9; nothing smaller to name
    assert flux2_refusal("mesh.tp=auto", "mesh.dp=1", "mesh.chip_memory_gib=16") == (
        f"mesh.tp=auto: no tp up to 8 fits a v6e chip: at tp=8, {flux2_need_text(8)} > 14.4 GiB usable; use more "
        "chips (mesh.tp), execution.offload=model, a smaller generate.batch_size or size"
    )
    assert flux2_refusal("mesh.tp=auto", "mesh.chip=auto") == (  # a TPU host that does not say which TPU
        "mesh.tp=auto needs the chip's memory (set mesh.chip or mesh.chip_memory_gib); or set mesh.tp to a number"
    )


def test_tp_auto_without_the_models_configs_and_dp_auto_without_the_chips_per_host_are_one_line():
    from launcher.config import load_config
    from launcher.sizing.mesh_plan import plan_mesh

    cfg = load_config("flux2_tp", ["mesh.tp=auto"])
    with pytest.raises(ConfigError) as e:
        plan_mesh(cfg, "tpu", None)
    assert str(e.value) == "mesh.tp=auto needs the model's configs; or set mesh.tp to a number"
    assert flux2_refusal("mesh.dp=auto", "mesh.chips_per_host=null") == (
        "mesh.dp=auto needs the number of chips per host; set mesh.chips_per_host"
    )
    plan, cfg = flux2_plan(
        "mesh.dp=auto", "mesh.tp=4", "mesh.chips_per_host=8", "mesh.nodes=2", "mesh.chip_memory_gib=95"
    )
    assert (plan.dp, cfg.mesh.dp) == (4, 4) and plan.why == ["dp=auto chose 4: 8 chips per host x 2 hosts / tp 4"]
    plan, _ = flux2_plan("mesh.dp=auto", "mesh.tp=8", "mesh.chips_per_host=8")
    assert plan.why == ["dp=auto chose 1: 8 chips per host / tp 8"]
    assert flux2_refusal("mesh.dp=0", "mesh.tp=0") == (
        "mesh.dp=0 and mesh.tp=0 must be at least 1 (processes = mesh.dp * mesh.tp)"
    )
    assert (
        flux2_refusal("mesh.dp=auto", "mesh.nodes=0")
        == "mesh.nodes=0 must be at least 1 (processes = mesh.dp * mesh.tp)"
    )


def test_a_hub_id_not_yet_here_is_fetched_then_checked_and_its_mesh_planned_once(model_hub, tmp_path):
    """preflight.py's words: where nothing was known of the model (a hub id neither cached nor in the table), the
    steps that need its configs run again once `fetch` has the files; tp=auto is decided then, once."""
    from launcher.checks.preflight import preflight
    from launcher.config import load_config

    job = [f"model.path={REPO}", "model.build=null", "mesh.tp=auto", "mesh.dp=auto", "device=cpu"]
    job += ["mesh.chip=cpu", "mesh.chip_memory_gib=64", f"output.dir={tmp_path / 'out'}"]
    pf = preflight(load_config("tiny", job))
    assert pf.model.root is not None and pf.model.root.name != REPO and pf.model.configs
    assert (pf.mesh.dp, pf.mesh.tp) == (1, 1)
    head = "tp=auto chose 1: the smallest tp that divides the sharded heads and fits: "
    assert len(pf.mesh.why) == 2 and pf.mesh.why[0].startswith(head), pf.mesh.why
    assert pf.mesh.why[0].endswith(" GiB per rank of 57.6 GiB usable")  # 64 GiB less 10 %
    assert pf.mesh.why[1] == "dp=auto chose 1: 1 chips per host / tp 1"  # cpu: one process a host unless told
    assert not (tmp_path / "out").exists()  # the preflight writes nothing


def test_the_workers_get_the_mesh_the_launcher_resolved_in_place_of_auto():
    from types import SimpleNamespace

    from launcher.checks.prepare import worker_overrides

    cfg = OmegaConf.create({"mesh": {"dp": 4, "tp": 2}})
    given = ["mesh.tp=auto", "+mesh.dp=auto", "generate.seed=3", "mesh.nodes=1"]
    assert worker_overrides(given, cfg, SimpleNamespace(why=["tp=auto chose 2"])) == [
        "generate.seed=3",
        "mesh.nodes=1",
        "mesh.dp=4",
        "mesh.tp=2",
    ]
    assert worker_overrides(given, cfg, SimpleNamespace(why=[])) == given  # nothing resolved: as given


@pytest.mark.parametrize(
    ("accelerator", "chip"),
    [("v6e-8", "v6e"), ("v5litepod-4", "v5e"), ("v5p-16", "v5p"), ("tpu7x-8", "v7x"), ("v9z-4", "v9z"), ("", "tpu")],
)
def test_a_tpu_vm_names_its_chip_from_its_accelerator_type(accelerator, chip, monkeypatch):
    """TPU VMs name their slice in TPU_ACCELERATOR_TYPE (v6e-8, v5litepod-4, tpu7x-8); its memory comes from the
    table of chips, not from the VM."""
    from launcher.sizing.mesh_plan import _detect

    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", accelerator)
    assert _detect("tpu") == (chip, None)


@pytest.mark.parametrize(
    ("answer", "code", "found"),
    [
        ("NVIDIA H100 80GB HBM3, 81559\nNVIDIA H100 80GB HBM3, 81559", 0, ("h100", 81559 / 1024)),
        ("NVIDIA H200, 143771", 0, ("h200", 143771 / 1024)),
        ("NVIDIA A100-SXM4-80GB, 81920", 0, ("NVIDIA A100-SXM4-80GB", 80.0)),  # not in the table: its own name
        ("NVIDIA H100, 81559", 9, ("cuda", None)),  # nvidia-smi failed
        ("no devices", 0, ("cuda", None)),
        ("", 0, ("cuda", None)),
    ],
)
def test_a_cuda_host_names_its_gpu_and_memory_from_nvidia_smi(answer, code, found, tmp_path, monkeypatch):
    """nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits: the first GPU's name and MiB; any
    failure leaves the chip unknown. A script stands in for nvidia-smi, which this host lacks."""
    from launcher.sizing.mesh_plan import _detect

    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        f"#!/bin/sh\n[ \"$*\" = '--query-gpu=name,memory.total --format=csv,noheader,nounits' ] || exit 3\n"
        f"printf '%s\\n' '{answer}'\nexit {code}\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert _detect("cuda") == found


def test_an_nvidia_smi_that_never_answers_leaves_the_chip_unknown_within_its_bound(tmp_path, monkeypatch):
    """A hung driver (nvidia-smi waiting on a GPU that fell off the bus) must not hang the launch."""
    import time

    from launcher.sizing import mesh_plan

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexec sleep 60\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(mesh_plan, "DETECT_TIMEOUT_S", 0.5)
    start = time.monotonic()
    assert mesh_plan._detect("cuda") == ("cuda", None)
    assert time.monotonic() - start < 30


def test_a_cpu_host_is_its_own_chip_with_its_ram_and_an_unknown_device_is_unknown(monkeypatch):
    from launcher.sizing.mesh_plan import _detect

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    assert _detect("cpu") == ("cpu", round(ram, 1))
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi at all
    assert _detect("cuda") == ("cuda", None)
    assert _detect("xla") == ("xla", None)


@pytest.mark.parametrize(
    ("overrides", "copies", "per_pixel"),
    [
        ([], 1, 1.8),  # the default: PNG bytes embedded in the Parquet only
        (["output.image_files=true"], 2, 1.8),  # and as files
        (["output.image_files=true", "output.embed_images=false"], 1, 1.8),  # the rows point at the files
        (["output.webdataset=true", "output.format=jpeg"], 2, 0.35),
        (["output.parquet=false", "output.webdataset=true", "output.format=webp"], 1, 0.25),
        (["output.image_files=true", "output.webdataset=true"], 3, 1.8),
    ],
)
def test_the_bytes_of_a_job_are_its_pixels_in_each_copy_it_writes(overrides, copies, per_pixel):
    """space.py's estimate: bytes per pixel of the format (PNG 1.8, JPEG 0.35, WebP 0.25, measured on photographic
    images) times each copy of the images the output keeps (files, embedded in the Parquet, WebDataset)."""
    from launcher.config import load_config
    from launcher.sizing.space import estimate_bytes

    cfg = load_config("tiny", ["generate.height=128", "generate.width=256", *overrides])
    assert estimate_bytes(cfg, 10) == int(10 * 128 * 256 * per_pixel * copies)


def test_a_bookkeeping_write_that_the_output_refuses_is_said_and_any_other_error_raised(caplog):
    """best_effort's words: True where the output refused the write (no room, no permission), with one warning
    naming what and the error's first line; any other error is raised; False where it was written."""
    import errno

    from launcher.sizing.space import best_effort

    def fail(error):
        raise error

    assert best_effort("run.json", lambda: None) is False
    full = OSError(errno.ENOSPC, "No space left on device\nsecond line")
    with caplog.at_level("WARNING", logger="launcher.sizing.space"):
        assert best_effort("the ledger's index", fail, full) is True
    assert [r.getMessage() for r in caplog.records] == [
        "could not write the ledger's index: [Errno 28] No space left on device"
    ]
    with pytest.raises(OSError) as e:
        best_effort("run.json", fail, OSError(errno.ECONNRESET, "reset"))
    assert e.value.errno == errno.ECONNRESET


def test_tp_auto_only_takes_a_tp_that_divides_every_sharded_models_heads(monkeypatch):
    """The transformer's 48 heads and the text encoder's 32 query and 8 key-value heads: with the text encoder
    whole (43.5 GiB a rank), tp=5 would fit a 67 GiB chip first but divides no 48, so tp=6 is taken; over two hosts
    of 8 chips tp=16 would fit a 16 GiB chip but 8 key-value heads do not split 16 ways."""
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    whole = ["model.shard_text_encoder=false", "mesh.dp=1", "mesh.tp=auto", "mesh.chip_memory_gib=67"]
    plan, _ = flux2_plan(*whole)

    def need(tp):  # the text encoder whole on each rank
        r = flux2_rank_gib(tp)
        total, _ = FLUX2_DEV_PARAMS["text_encoder"]
        return r["transformer"] + total * 2 / GIB + r["vae"] + 2

    assert plan.tp == 6 and plan.why[0].endswith(f"of 60.3 GiB usable; tp=4 would need {need(4):.1f} GiB")
    assert need(5) <= 0.9 * 67 < need(4)  # the fixture reaches the case: tp=5 fits, and is refused for its heads
    hosts = ["mesh.dp=1", "mesh.tp=auto", "mesh.nodes=2", "mesh.chips_per_host=8", "mesh.chip_memory_gib=16"]
    assert flux2_refusal(*hosts).startswith("mesh.tp=auto: no tp up to 8 fits a v6e chip: at tp=8, ")
    assert sum(flux2_rank_gib(16).values()) + 2 <= 0.9 * 16  # tp=16 fits but does not divide 8 kv heads
    # A host of 3 chips: tp=3 divides no 32 heads, and tp=4 would fit and divide every head, but is past the chips.
    three = ["mesh.dp=1", "mesh.tp=auto", "mesh.chips_per_host=3", "mesh.chip_memory_gib=40"]
    assert flux2_refusal(*three).startswith("mesh.tp=auto: no tp up to 2 fits a v6e chip: at tp=2, ")
    assert sum(flux2_rank_gib(4).values()) + 2 <= 0.9 * 40 < sum(flux2_rank_gib(2).values()) + 2


def test_parameter_counts_are_cached_by_architecture_where_the_guide_says(tmp_path, monkeypatch):
    """docs/guide.md: counts are cached in ~/.cache/meshgen (MESHGEN_CACHE_DIR); the same architecture is counted
    once whatever its config's bookkeeping keys (_name_or_path, architectures, torch_dtype) or their order."""
    from launcher.models.checkpoints import PUBLISHED
    from launcher.sizing import memory

    monkeypatch.delenv("MESHGEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert memory.cache_path() == tmp_path / "xdg" / "meshgen" / "param_counts.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert memory.cache_path() == tmp_path / "home" / ".cache" / "meshgen" / "param_counts.json"
    monkeypatch.setenv("MESHGEN_CACHE_DIR", str(tmp_path / "counts"))
    assert memory.cache_path() == tmp_path / "counts" / "param_counts.json"

    library, cls, config = PUBLISHED["black-forest-labs/FLUX.2-dev"]["vae"]
    first = memory.counts((library, cls, config))
    assert len(json.loads(memory.cache_path().read_text())) == 1
    noted = {"_name_or_path": "/x", "architectures": ["A"], "torch_dtype": "bfloat16", **config}
    assert memory.counts((library, cls, dict(reversed(noted.items())))) == first
    assert len(json.loads(memory.cache_path().read_text())) == 1  # the same architecture: no new count
    other = {**config, "block_out_channels": [64, 128, 256, 256]}
    assert memory.counts((library, cls, other)).total < first.total
    assert len(json.loads(memory.cache_path().read_text())) == 2


@pytest.mark.parametrize(("where", "at"), [({"file": "p.txt", "line": 3}, "p.txt, line 3"), ({"file": None}, "row 7")])
def test_the_run_record_times_the_run_by_its_own_clock_and_names_the_first_row_set_aside(
    tmp_path, monkeypatch, where, at
):
    """summary.py's words: durations from the monotonic clock; the start-up is launch to the first shard's start by
    the workers' clock, held within the run; stages summed over this run's shards; a missing `truncated` counts 0;
    the bad rows set aside are counted and the first named by file and line, or by its row."""
    from launcher.host import summary
    from launcher.ledger.states import Ledger
    from launcher.ledger.store import Store
    from launcher.plan.plan import Plan, ShardPlan

    store = Store(tmp_path)
    ours = {"status": "done", "rows": 2, "run_id": "now", "prompts_fingerprint": "fp"}
    for i, st in enumerate(
        [
            {**ours, "started_at": 1_000_006.5, "stages": {"denoise": 0.1234, "decode": 0.5}, "truncated": None},
            {**ours, "started_at": 1_000_004.25, "stages": {"denoise": 0.0007}, "truncated": 2},
            {**ours, "status": "failed", "rows": 0, "started_at": 1_000_002.0, "truncated": 9},
        ]
    ):
        store.write_json(f"state/shard-{i:05d}.json", st)
    rejected = [{"position": 7, "reason": "its id is empty", "line": None, **where}, {"position": 9, "reason": "x"}]
    plan = Plan([ShardPlan(i, 2, "fp", "pending") for i in range(3)], [0, 1, 2], [], rejected=rejected)
    monkeypatch.setattr(summary.time, "monotonic", lambda: 110.0)  # 10 s after the launch's start=100
    monkeypatch.setattr(summary.time, "time", lambda: 1_000_010.0)  # so the run began at 1,000,000 by the wall
    lines, record = summary.summarize(store, Ledger(store), plan, "now", 100.0, 0, ["./launch.sh"])
    assert record["start"] == time_iso(1_000_000.0) and record["end"] == time_iso(1_000_010.0)
    assert (record["seconds"], record["images_per_s"], record["startup_s"]) == (10.0, 0.4, 2.0)
    assert record["stages"] == {"denoise": 0.124, "decode": 0.5} and record["truncated_prompts"] == 2
    assert (record["rejected"], record["rejected_file"]) == (2, "rejected/now.parquet")  # DESIGN's layout
    assert lines[2] == (
        "time per stage (s, summed over shards): decode 0.5, denoise 0.124; start-up 2.0 s (launch to the first "
        "shard: imports, model load)"
    )
    assert lines[4] == (
        f"2 bad rows set aside (dataset.bad_rows=skip), each with its reason in {tmp_path}/rejected/now.parquet; "
        f"the first: {at}: its id is empty"
    )
    # A worker's clock ahead of the launcher's: the start-up is held within the run's own duration.
    monkeypatch.setattr(summary.time, "time", lambda: 999_990.0)
    assert summary.summarize(store, Ledger(store), plan, "now", 100.0, 0, ["x"])[1]["startup_s"] == 10.0
    monkeypatch.setattr(summary.time, "time", lambda: 1_000_030.0)  # behind: never below 0
    assert summary.summarize(store, Ledger(store), plan, "now", 100.0, 0, ["x"])[1]["startup_s"] == 0.0


def time_iso(t: float) -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


def test_the_run_record_names_the_code_by_git_describe_and_a_copy_outside_git_by_nothing(tmp_path, monkeypatch):
    """The record's `code`: `git describe --always --dirty` of the checkout that ran (a commit, `-dirty` where it has
    changes); None where the code is not in a git checkout (an installed copy)."""
    import subprocess

    from conftest import REPO

    from launcher.host import summary

    described = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert described and summary.code_version() == described
    copy = tmp_path / "site-packages" / "launcher" / "host"
    copy.mkdir(parents=True)
    monkeypatch.setattr(summary, "__file__", str(copy / "summary.py"))
    assert summary.code_version() is None


def test_h_is_help_cfg_job_prints_the_yaml_once_and_a_tpu_dry_run_names_each_hosts_processes(
    launcher_main, capsys, tmp_path, monkeypatch
):
    """`-h` is `--help`; `--cfg job` prints the composed YAML as it is (no blank line after); a dry run of a job
    over 2 TPU hosts of dp=2 x tp=8 prints TorchTPU's launch line with nproc_per_node=8 (processes per host)."""
    from conftest import REPO

    assert launcher_main(["-h"]) == 0 and "conf=" in capsys.readouterr().out
    assert launcher_main(["--cfg", "job", "conf=tiny"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and not out.endswith("\n\n")
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    prompts = f"dataset.path={REPO / 'conf' / 'prompts' / 'tiny.txt'}"
    args = ["--dry-run", "conf=flux2_tp", prompts, "mesh.nodes=2", "mesh.dp=2", "mesh.tp=8", f"output.dir={tmp_path}"]
    assert launcher_main(args) == 0, capsys.readouterr().err[-2000:]
    lines = capsys.readouterr().out.splitlines()
    assert (
        'eval "$(python -m torch.tpu.distributed)"  # TorchTPU launch env: set_tpu_launch_env(nnodes=2, '
        "nproc_per_node=8)"
    ) in lines
    assert any(ln.startswith("torchrun ") and "--nproc-per-node=8" in ln for ln in lines), lines


def test_the_rendezvous_address_is_torchruns(monkeypatch):
    """launcher/checks/settings.py: the store the hosts meet at is MASTER_ADDR:MASTER_PORT, as torchrun reads them
    (docs/guide.md's two-host launch sets both), and torchrun's own defaults where unset: 127.0.0.1, 29500."""
    from launcher.checks.settings import store_address

    monkeypatch.setenv("MASTER_ADDR", "10.0.0.2")
    monkeypatch.setenv("MASTER_PORT", "29600")
    assert store_address() == ("10.0.0.2", 29600)
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.delenv("MASTER_PORT")
    assert store_address() == ("127.0.0.1", 29500)


def test_a_download_errors_cause_is_found_down_its_chain():
    """launcher/checks/download.py: a gated or missing repo is told by the cause of what the download raised, however
    deep the library wrapped it (raised from it, or raised while handling it); a chain without one gives none."""
    import requests
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    from launcher.checks.download import _root_cause

    wanted, answer = (GatedRepoError, RepositoryNotFoundError), requests.Response()
    answer.status_code = 403
    gated = GatedRepoError("gated", response=answer)
    try:
        try:
            raise gated
        except GatedRepoError as e:
            try:
                raise OSError("cannot load the model") from e
            except OSError:
                raise RuntimeError("while loading")  # noqa: B904 - the implicit context is the case
    except RuntimeError as top:
        assert _root_cause(top, wanted) is gated
    assert _root_cause(gated, wanted) is gated
    assert _root_cause(RuntimeError("plain"), wanted) is None


def test_an_unknown_tiny_builder_is_one_line_naming_those_the_confs_declare():
    """model.build: the builders are the `build:` values of conf/model/*.yaml; another is refused naming them."""
    import yaml

    from launcher.checks.family_checks import tiny_family
    from launcher.config import load_config
    from launcher.errors import ConfigError

    declared = sorted(
        b
        for f in Path(__file__).parents[1].glob("conf/model/*.yaml")
        if (b := yaml.safe_load(f.read_text()).get("build"))
    )
    with pytest.raises(ConfigError) as e:
        tiny_family(load_config("tiny", ["model.build=tiny_nope"]))
    assert str(e.value) == f"model.build='tiny_nope' is unknown; builders: {', '.join(declared)} (or null)"


def test_the_memory_plan_counts_each_quality_model_that_is_on_and_n_images_a_call():
    """launcher/sizing: the quality models on a writing rank are counted each when on, whichever else is (the bytes
    of both are the sum of each alone); a call denoises batch_size x images_per_prompt images, so its working
    margin doubles with two images a prompt."""
    from launcher.config import load_config
    from launcher.sizing.memory import quality_bytes
    from launcher.sizing.mesh_plan import _activation_gib

    def q(clip: bool, safety: bool) -> int:
        return quality_bytes(load_config("tiny", [f"quality.clip_score={clip}", f"quality.safety={safety}"]))

    assert q(False, False) == 0 and q(True, False) > 0 and q(False, True) > 0
    assert q(True, True) == q(True, False) + q(False, True)
    one, two = (_activation_gib(load_config("tiny", [f"generate.images_per_prompt={n}"])) for n in (1, 2))
    assert one > 0 and two == pytest.approx(2 * one)


def test_the_mesh_line_of_a_chip_of_unknown_memory_says_so():
    """docs/guide.md's mesh line (`# mesh: dp=1 tp=8 (v6e, 32 GiB per chip; per rank: ...)`), for a chip whose
    memory is not known: `?` in its place, and the parts' bytes per rank still."""
    from launcher.sizing import memory
    from launcher.sizing.mesh_plan import Chip, MeshPlan

    per_rank = {"transformer": 3 * memory.GIB, "text_encoder": memory.GIB, "vae": memory.GIB // 4}
    plan = MeshPlan(1, 2, Chip("a future chip", None, 4), per_rank)
    assert plan.line() == (
        "# mesh: dp=1 tp=2 (a future chip, ? GiB per chip; per rank: transformer 3.0 GiB, text_encoder 1.0 GiB, "
        "vae 0.2 GiB)"
    )


def test_a_dry_run_says_when_it_cannot_fingerprint_weights_not_here_yet(tiny_model, empty_cache):
    """launcher/checks/preflight.py: a dry run of a hub id this host has not downloaded says, in one note, that the
    real run fingerprints the weights once they are here; not where they are here, and never in a real run."""
    from launcher.checks.preflight import Preflight, weights
    from launcher.config import load_config

    def notes(path: str, dry_run: bool) -> list[str]:
        pf = Preflight(load_config("tiny", [f"model.path={path}", "model.build=null"]), dry_run=dry_run)
        weights(pf)
        return pf.notes

    assert notes("org/not-here-yet", True) == [
        "# weights: org/not-here-yet is not on this host yet, so this dry run cannot fingerprint them; the real run "
        "does once they are here, and refuses a folder made with other weights then"
    ]
    assert notes(str(tiny_model), True) == [] and notes("org/not-here-yet", False) == []


def test_a_run_whose_images_would_not_fit_says_so_once_before_it_starts(tmp_path, monkeypatch, caplog):
    """launcher/sizing/space.py: the free space where the output lives against the images the run makes (its bytes
    estimate_bytes says): one warning when short, none when they fit or where no free space is known (S3)."""
    from launcher.config import load_config
    from launcher.ledger.store import Store
    from launcher.sizing import space

    cfg, store = load_config("tiny"), Store(tmp_path)
    need = space.estimate_bytes(cfg, 10)
    for free, said in ((need - 1, True), (need, False), (None, False)):
        monkeypatch.setattr(space, "free_bytes", lambda s, f=free: f)
        caplog.clear()
        with caplog.at_level("WARNING"):
            space.warn_if_short(cfg, store, 10)
        lines = [r.getMessage() for r in caplog.records]
        assert bool(lines) is said, lines
        if said:
            assert lines[0].startswith(f"{store} has ") and ", but the 10 images to generate need about " in lines[0]
            assert lines[0].endswith("; the run will stop when it is full")
    assert space.estimate_bytes(cfg, 20) == 2 * need > 0


class _FlatConfig:
    @staticmethod
    def from_dict(values: dict):
        import types

        return types.SimpleNamespace(**values)


class KeepsFloat32:
    """A transformers-style model (built from its config class) that keeps `wo` in float32 for float16 only and
    `gate` in float32 for every half type, as transformers' `_keep_in_fp32_modules(_strict)` say."""

    config_class = _FlatConfig

    def __new__(cls, config):  # a plain torch module, built where the count builds it (the meta device)
        import torch

        model = torch.nn.Module()
        model.config = config
        model.wo, model.gate, model.other = (torch.nn.Linear(i, o, bias=False) for i, o in ((4, 8), (2, 3), (5, 5)))
        model._keep_in_fp32_modules, model._keep_in_fp32_modules_strict = ["wo"], ["gate"]
        return model


def test_weights_kept_in_float32_are_counted_at_four_bytes_in_the_half_types_that_keep_them(tmp_path, monkeypatch):
    """launcher/sizing/memory.py: `_keep_in_fp32_modules` are float32 in float16 only, `_keep_in_fp32_modules_strict`
    in float16 and bfloat16 (transformers' loading rules); the rest at the dtype's bytes."""
    from launcher.sizing import memory

    monkeypatch.setenv("MESHGEN_CACHE_DIR", str(tmp_path))  # counted here, not read from an earlier count

    c = memory.counts(("test_host_functions", "KeepsFloat32", {"size": 1}))
    assert (c.total, c.fp32_half, c.fp32_strict) == (32 + 6 + 25, 32, 6)
    assert c.rank_bytes(1, "float32", False) == 63 * 4
    assert c.rank_bytes(1, "bfloat16", False) == 63 * 2 + 6 * 2
    assert c.rank_bytes(1, "float16", False) == 63 * 2 + (6 + 32) * 2


def test_a_component_is_complete_by_its_weight_files_whatever_its_index_files_hold(tmp_path):
    """launcher/sizing/model_files.py: a component folder is complete when one index has all its shards, or a
    weight file stands alone; an index with no weight_map (another format's, a damaged one) maps nothing."""
    from launcher.errors import ConfigError
    from launcher.sizing.model_files import check_components

    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "P", "transformer": ["diffusers", "T"]}))
    part = tmp_path / "transformer"
    part.mkdir()
    (part / "config.json").write_text("{}")
    (part / "other.index.json").write_text(json.dumps({"metadata": {}}))
    (part / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "m-1.safetensors"}}))
    with pytest.raises(ConfigError, match=r"transformer/ lacks weight files \['m-1\.safetensors'\]; download"):
        check_components("org/p", tmp_path)
    (part / "m-1.safetensors").write_bytes(b"w")
    check_components("org/p", tmp_path)
    (part / "model.safetensors.index.json").unlink()
    check_components("org/p", tmp_path)  # m-1 now stands alone


def test_shard_files_stand_only_with_an_index_that_names_them(tmp_path):
    """A checkpoint's shards are named "<name>-00002-of-00012.<ext>" (transformers' and diffusers' naming), and
    both libraries load them only through the index that names them: beside an index that names nothing (damaged),
    even a whole set is incomplete, and the error says what is lacking; the index made whole, the component is."""
    from launcher.errors import ConfigError
    from launcher.sizing.model_files import check_components

    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "P", "transformer": ["diffusers", "T"]}))
    part = tmp_path / "transformer"
    part.mkdir()
    (part / "config.json").write_text("{}")
    index = part / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {}}))
    names = [f"diffusion_pytorch_model-{i:05d}-of-00012.safetensors" for i in range(1, 13)]
    for name in names:
        (part / name).write_bytes(b"w")
    with pytest.raises(ConfigError) as e:
        check_components("org/p", tmp_path)
    assert str(e.value) == (
        "model.path org/p is an incomplete pipeline: transformer/ lacks an index naming its weight shards "
        f"{names[:3]}; download the whole pipeline again"
    )
    index.write_text(json.dumps({"weight_map": {f"layer{i}": n for i, n in enumerate(names)}}))
    check_components("org/p", tmp_path)
    (part / names[9]).unlink()
    with pytest.raises(ConfigError, match=rf"transformer/ lacks weight files \['{names[9]}'\]; download"):
        check_components("org/p", tmp_path)


def test_the_largest_part_counts_where_the_parts_take_turns_also_when_it_is_the_text_encoder():
    """docs/guide.md: with execution.staged the text encoder and the transformer take turns on the chip (the VAE
    stays), with model offload each component goes on alone: the larger of those that take turns counts, also where
    that is the text encoder."""
    from omegaconf import OmegaConf

    from launcher.sizing import memory
    from launcher.sizing.mesh_plan import need_gib

    per_rank = {"transformer": 6 * memory.GIB, "text_encoder": 10 * memory.GIB, "vae": memory.GIB}
    for execution, weights in (({"offload": "none", "staged": True}, 10 + 1), ({"offload": "model"}, 10)):
        cfg = OmegaConf.create({"generate": {"batch_size": 1, "height": 1024, "width": 1024}, "execution": execution})
        assert need_gib(cfg, per_rank) == weights + 2.0  # + 2 GiB per megapixel of a batch


# host room, part launch: the books of a run that has shards to do (launcher/host/launch.py's keep_books and
# generate), in this process, with a stand-in for the workers (run_hosts) that acts as they would.


def prom_samples(path: Path) -> dict[str, str]:
    """A Prometheus textfile's samples by name, labels left off (each metric here has one sample)."""
    if not path.exists():
        return {}
    return {ln.split("{")[0]: ln.rsplit(" ", 1)[1] for ln in path.read_text().splitlines() if not ln.startswith("#")}


JOB_FILE = (
    "defaults:\n  - schema\n  - model: tiny_flux2\n  - mesh: cpu_tp2\n  - _self_\n"
    "device: cpu\ngenerate:\n  height: 64\n  width: 64\n  num_inference_steps: 2\n  max_sequence_length: 256\n"
    "  batch_size: 2\n  images_per_prompt: 2\n  sweep:\n    guidance_scale: [2.5, 4.0]\nrun:\n  shard_size: 8\n"
)


def test_a_run_with_shards_to_do_hands_the_workers_its_plan_run_id_and_logs_and_its_books_follow_them(
    launcher_main, tiny_model, tmp_path, capsys, monkeypatch
):
    """A job file (relative to the working folder) of 3 prompts, 2 images each, swept over 2 guidance scales: one
    shard of 12 samples. Before the workers start, the space check is asked about those 12 samples, the run's plan
    (DESIGN: plans/<run id>.arrow) holds the shard's rows, MESHGEN_RUN_ID is the run's id, the workers' logs go to
    logs/<run id>/, and the workers get this host's torchrun command with the job file's absolute path (they may
    start in another folder). While they run, output.metrics follows the shards they finish; after, the plan is
    gone, the run is exit 0 with its record, and run.stale=keep with nothing stale warns of nothing. The launcher's
    lines read `[launcher]` (docs/guide.md) at INFO, whatever RANK a scheduler set (Kubeflow's PyTorchJob sets one a
    pod): RANK is its workers'."""
    import pyarrow as pa

    from launcher.host import launch
    from launcher.host.worker_start import START_ENV

    monkeypatch.setenv(START_ENV, "subprocess")  # no workers' server forked for a stand-in
    monkeypatch.setenv("RANK", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.yaml").write_text(JOB_FILE)
    prompts, out, prom = tmp_path / "p.txt", tmp_path / "out", tmp_path / "textfile" / "meshgen.prom"
    prompts.write_text("a\nb\nc\n")
    warned, seen = [], {}
    real_warn = launch.warn_if_short

    def warn_if_short(cfg, store, images):
        warned.append((str(store), images))
        real_warn(cfg, store, images)

    def workers(cfg, plan_, logs=None):
        run_id = os.environ["MESHGEN_RUN_ID"]
        with pa.OSFile(str(out / "plans" / f"{run_id}.arrow")) as f:
            table = pa.ipc.open_file(f).read_all()
        fingerprint = json.loads(table.schema.metadata[b"meshgen_plan"])["shards"][0][1]
        seen.update(run_id=run_id, dir=cfg.output.dir, args=plan_.torchrun_args, log=logs.rank_log(0))
        seen["prompts"] = table.column("prompt").to_pylist()
        (out / "state").mkdir(exist_ok=True)  # a worker's state for its finished shard
        done = {"status": "done", "rows": 12, "run_id": run_id, "prompts_fingerprint": fingerprint, "files": {}}
        (out / "state" / "shard-00000.json").write_text(json.dumps(done))
        until(lambda: prom_samples(prom).get("meshgen_shards_done") == "1", timeout_s=15)  # the bar's look: 1 s
        return 0

    monkeypatch.setattr(launch, "warn_if_short", warn_if_short)
    monkeypatch.setattr(launch, "run_hosts", workers)
    args = [f"model.path={tiny_model}", f"output.dir={out}", f"dataset.path={prompts}", f"output.metrics={prom}"]
    args.append("run.stale=keep")
    assert launcher_main(["conf=job.yaml", *args]) == 0, capsys.readouterr().err[-2000:]
    run_id = seen["run_id"]
    assert warned == [(str(out), 12)]
    assert seen["prompts"] == ["a", "b", "c"] and seen["dir"] == str(out)
    assert seen["log"] == f"{out}/logs/{run_id}/rank-0.log"
    assert seen["args"][-len(args) - 2 :] == ["launcher.worker.main", f"conf={tmp_path / 'job.yaml'}", *args]
    assert not (out / "plans" / f"{run_id}.arrow").exists()
    record = json.loads((out / "runs" / f"{run_id}.json").read_text())
    assert record["exit_code"] == 0
    assert prom_samples(prom)["meshgen_samples_planned"] == "12" and prom_samples(prom)["meshgen_samples_done"] == "12"
    assert f'output="{out}",run_id="{run_id}"' in prom.read_text()
    err = capsys.readouterr().err
    assert "keeping shards" not in err
    assert any(
        ln.startswith("[launcher] ") and "INFO launcher.host.launch: generating 1 shards" in ln
        for ln in err.splitlines()
    )


@pytest.mark.parametrize("refused", ["run.json", "plan", None])
def test_a_bookkeeping_write_the_full_output_refuses_starts_no_worker_and_the_last_line_says_so(
    refused, launcher_main, tiny_model, tmp_path, capsys, monkeypatch
):
    """DESIGN: a full output stops the run cleanly (exit 3) and its last line says what stopped it and how to
    finish. A write of the launcher's own books refused for want of room (run.json, or the run's plan) starts no
    worker, whatever later writes succeed (the kept stale shard's mark here); workers that fail on an output with
    room are exit 3 without that line. Conf tiny: shards 0 and 2 to do, shard 1 done but stale, kept. A run with
    nothing selected and nothing held says there is nothing to do; one with shards to do never does."""
    import errno

    import launcher.ledger.runs
    import launcher.plan.plan
    from launcher.host import launch
    from launcher.host.worker_start import START_ENV

    monkeypatch.setenv(START_ENV, "subprocess")
    out = tmp_path / "out"
    base = ["conf=tiny", f"model.path={tiny_model}", f"output.dir={out}"]
    assert launcher_main([*base, "run.shards=failed"]) == 0, capsys.readouterr().err[-2000:]
    (out / "state").mkdir()
    done = {"status": "done", "rows": 8, "prompts_fingerprint": "of-other-prompts", "files": {}}
    (out / "state" / "shard-00001.json").write_text(json.dumps(done))

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    if refused == "run.json":
        monkeypatch.setattr(launcher.ledger.runs, "write_run_json", full)
    elif refused == "plan":
        monkeypatch.setattr(launcher.plan.plan, "write_plan_file", full)
    started = []
    monkeypatch.setattr(launch, "run_hosts", lambda cfg, plan_, logs=None: started.append(1) or 3)
    assert "INFO launcher.host.launch: nothing to do: every selected shard of" in capsys.readouterr().err
    assert launcher_main([*base, "run.stale=keep"]) == 3
    said = capsys.readouterr()
    last = said.err.strip().splitlines()[-1]
    assert len(json.loads((out / "state" / "shard-00001.json").read_text())) == len(done) + 1  # kept: marked
    if refused is None:
        assert started == [1] and "out of space" not in said.err + said.out
        return
    assert started == [] and "error" not in said.out and "nothing to do" not in said.err  # 2 shards are to do
    assert last.startswith(f"error: {out} is out of space (") and last.endswith(
        " free); free some space and run the same command again to finish"
    )


def test_cfg_job_with_its_value_after_an_equals_sign_leaves_the_next_argument():
    """`--cfg=job` is one argument: the override after it stays (a gap would drop it as the value)."""
    from launcher.host.launch import _take_cfg_flag

    argv = ["--cfg=job", "conf=tiny", "x=1"]
    assert _take_cfg_flag(argv) is True and argv == ["conf=tiny", "x=1"]


def test_the_rerun_command_makes_absolute_a_path_whose_folder_names_hold_an_equals_sign():
    """A Hive-style folder (`date=2024-05-01`) in a path: the key is what comes before the first `=`."""
    from launcher.config import REPO_ROOT
    from launcher.host.launch import rerun_command

    cfg = launch_cfg()
    cfg.output.dir = "/data/date=2024-05-01"
    assert rerun_command(cfg, "tiny", ["output.dir=date=2024-05-01"]) == [
        str(REPO_ROOT / "launch.sh"),
        "conf=tiny",
        "output.dir=/data/date=2024-05-01",
    ]


def test_the_tpu_launch_env_names_two_hosts_and_refuses_a_torch_tpu_without_its_setter(monkeypatch):
    """TorchTPU's set_tpu_launch_env takes nnodes=None on one host only: two hosts are nnodes=2. A torch.tpu.distributed
    without set_tpu_launch_env is a torch_tpu older than 0.2.0: the upgrade line, not an AttributeError."""
    import sys
    import types

    import torch

    from launcher.host.launch import set_tpu_launch_env

    calls = []
    setter = types.SimpleNamespace(set_tpu_launch_env=lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch, "tpu", types.SimpleNamespace(distributed=setter), raising=False)
    set_tpu_launch_env(2, 8)
    assert calls == [{"nnodes": 2, "nproc_per_node": 8}]
    monkeypatch.setattr(torch, "tpu", types.SimpleNamespace(distributed=types.SimpleNamespace()))
    old = "torch_tpu._internal.distributed.launchers"
    for name in ("torch_tpu", "torch_tpu._internal", "torch_tpu._internal.distributed", old):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[old].singlehost_wrapper = object()  # ty: ignore[unresolved-attribute]
    with pytest.raises(ConfigError, match=r"^torch_tpu is older than 0\.2\.0 "):
        set_tpu_launch_env(1, 8)


def test_the_launcher_reads_its_arguments_after_the_programs_name(launcher_main, capsys, monkeypatch):
    """launch.sh execs `python -m launcher.host.launch "$@"`: main() with no list reads sys.argv[1:]."""
    import sys

    monkeypatch.setattr(sys, "argv", ["launch.py", "--cfg", "job", "conf=tiny", "generate.seed=7"])
    assert launcher_main() == 0, capsys.readouterr().err[-2000:]
    assert OmegaConf.create(capsys.readouterr().out).generate.seed == 7


def test_a_tpu_launch_sets_torchtpus_launch_env_with_this_hosts_processes_before_the_workers(
    launcher_main, capsys, monkeypatch, tmp_path
):
    """DESIGN: on TPU the launcher sets TorchTPU's launch env once, before any worker starts; a job of 2 hosts of
    dp=2 x tp=8 runs 8 processes a host (an int: TorchTPU writes it into the workers' environment). The checks of
    a real TPU host are those of a dry run here (no TPU on this host); the run itself is stood in for."""
    from conftest import REPO

    import launcher.checks.preflight
    from launcher.host import launch

    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    real = launcher.checks.preflight.preflight
    monkeypatch.setattr(launcher.checks.preflight, "preflight", lambda cfg, dry_run: real(cfg, True))
    order = []
    monkeypatch.setattr(launch, "set_tpu_launch_env", lambda nnodes, nproc: order.append(("env", nnodes, nproc)))
    monkeypatch.setattr(launch, "supervise", lambda pf, conf, overrides, plan_: order.append(("run", pf.device)) or 0)
    prompts = f"dataset.path={REPO / 'conf' / 'prompts' / 'tiny.txt'}"
    args = ["conf=flux2_tp", prompts, "mesh.nodes=2", "mesh.dp=2", "mesh.tp=8", f"output.dir={tmp_path}"]
    assert launcher_main(args) == 0, capsys.readouterr().err[-2000:]
    assert order == [("env", 2, 8), ("run", "tpu")] and type(order[0][2]) is int


def test_the_workers_outcome_is_the_launchs_exit_code_and_the_failed_rank_is_named_with_its_log(monkeypatch, caplog):
    """launch.py's words: torchrun's elastic launch in this process, given this host's torchrun command, the
    workers' log files and how they start, with LAUNCHER_PID_ENV naming this process while they run (and only
    then); the first failed worker's exit code is the run's, a worker killed by signal N is 128 + N, as is a
    signal that stops the launcher; the failed rank is named with its log file where the workers log to files.
    A job of one host starts no hosts' watch. torch's launch is stood in for (terminal.launch_workers)."""
    import signal
    import socket
    from types import SimpleNamespace as NS

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from launcher.errors import LAUNCHER_PID_ENV
    from launcher.host import launch, terminal

    # One host serves no hosts' store (peers.py): MASTER_PORT may be another program's, as it is here.
    held = socket.socket()
    held.bind(("", 0))
    held.listen()
    monkeypatch.setenv("MASTER_PORT", str(held.getsockname()[1]))
    seen, outcome = [], []

    def launch_workers(args, logs, start):
        seen.append((args.nproc_per_node, args.training_script, args.training_script_args, logs, start))
        seen.append(os.environ.get(LAUNCHER_PID_ENV))
        if outcome:
            raise outcome.pop()

    monkeypatch.setattr(terminal, "launch_workers", launch_workers)
    cfg = launch_cfg(dp=1, tp=2)
    plan_ = launch.launch_plan(cfg, "tiny", ["x=1"], "cuda")
    plan_.start = "forkserver"
    logs = NS(rank_log=lambda rank: f"/out/logs/run-1/rank-{rank}.log")
    assert launch.run_hosts(cfg, plan_, logs) == 0
    assert seen == [("2", "launcher.worker.main", ["conf=tiny", "x=1"], logs, "forkserver"), str(os.getpid())]
    assert LAUNCHER_PID_ENV not in os.environ
    for exitcode, expected in ((2, 2), (1, 1), (-signal.SIGKILL, 128 + signal.SIGKILL)):
        outcome.append(ChildFailedError("launcher.worker.main", {3: ProcessFailure(1, 4321, exitcode, "/nowhere")}))
        caplog.clear()
        assert launch.run_hosts(cfg, plan_, logs) == expected
        assert f"rank 3 failed first, exit code {exitcode}; its log: /out/logs/run-1/rank-3.log" in caplog.text
        assert LAUNCHER_PID_ENV not in os.environ
    outcome.append(ChildFailedError("launcher.worker.main", {0: ProcessFailure(0, 4321, 3, "/nowhere")}))
    caplog.clear()
    assert launch.run_hosts(cfg, plan_) == 3  # the workers' output on the terminal: no log file to name
    assert caplog.records[-1].getMessage() == "rank 0 failed first, exit code 3"
    outcome.append(SignalException("stopped", signal.SIGTERM))
    assert launch.run_hosts(cfg, plan_, logs) == 128 + signal.SIGTERM
    assert LAUNCHER_PID_ENV not in os.environ
    held.close()


@pytest.mark.parametrize("workers_code", [0, 130])
def test_a_failed_push_is_the_runs_error_line_and_exit_3_unless_a_signal_stopped_it(
    workers_code, launcher_main, tiny_model, tmp_path, capsys, monkeypatch
):
    """output.publish (launcher/publish/run.py): each done shard is offered to the push as the run sees it finish;
    the push is finished after the books, and a push that failed is `error: <why>` on stderr and exit 3 (the
    shards are done, the dataset is not where it should be), while a signal's code (130: SIGINT) stays. The
    publisher and the workers are stood in for."""
    import launcher.publish.run
    from launcher.host import launch
    from launcher.host.worker_start import START_ENV

    monkeypatch.setenv(START_ENV, "subprocess")
    prompts, out = tmp_path / "p.txt", tmp_path / "out"
    prompts.write_text("a\nb\nc\n")
    offered, finished = [], []
    publisher = type("Publisher", (), {"offer": offered.append, "finish": lambda self: finished.append(1) or "no"})
    monkeypatch.setattr(launcher.publish.run, "start_publisher", lambda cfg, store: publisher())

    def workers(cfg, plan_, logs=None):
        run_id = os.environ["MESHGEN_RUN_ID"]
        (out / "state").mkdir(exist_ok=True)
        import pyarrow as pa

        with pa.OSFile(str(out / "plans" / f"{run_id}.arrow")) as f:
            fingerprint = json.loads(pa.ipc.open_file(f).schema.metadata[b"meshgen_plan"])["shards"][0][1]
        done = {"status": "done", "rows": 3, "run_id": run_id, "prompts_fingerprint": fingerprint, "files": {}}
        (out / "state" / "shard-00000.json").write_text(json.dumps(done))
        return workers_code

    monkeypatch.setattr(launch, "run_hosts", workers)
    args = ["conf=tiny", f"model.path={tiny_model}", f"output.dir={out}", f"dataset.path={prompts}"]
    assert launcher_main(args) == (3 if workers_code == 0 else workers_code)
    said = capsys.readouterr()
    assert said.err.strip().splitlines()[-1] == "error: no" and "error" not in said.out
    assert [0] in offered and finished == [1]
    [record] = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    assert record["exit_code"] == workers_code  # the shard is done: only the push failed


def test_the_dry_runs_images_count_every_variant_of_a_sweep(monkeypatch):
    """DESIGN: a sweep makes each prompt's images once per variant: 10 prompts x 3 images x 2 guidance scales."""
    from types import SimpleNamespace as NS

    from launcher.host.launch import dry_run_lines
    from launcher.sizing import cost

    monkeypatch.setattr(cost, "cost_lines", lambda pf: [])
    gen = {"images_per_prompt": 3, "sweep": {"guidance_scale": [2.5, 4.0]}}
    cfg = OmegaConf.create(
        {"device": "cpu", "mesh": {"nodes": 1}, "workers": {"index": 0, "count": 1}, "generate": gen}
    )
    plan = NS(selected=[0], shards=[NS(status="pending")], held=[], rejected=[], prompts=lambda sel: 10 * len(sel))
    mesh = NS(chip=NS(name="cpu"), line=lambda: "# mesh: dp=1 tp=1", why=[])
    lines = dry_run_lines(NS(cfg=cfg, plan=plan, device="cpu", mesh=mesh, notes=[]))
    assert "# plan: 1 of 1 shards to generate (10 prompts, 60 images); 0 done, 0 failed, 0 stale" in lines


# host room, part launch (second): which host keeps the books and when the workers' server is forked early
# (launcher/host/launch.py's supervise); the books of a run with rows set aside or stale shards kept (keep_books,
# generate). The books, the workers or the hosts' agreement are stood in for.


@pytest.mark.parametrize(
    "nodes, node_rank, overwrite, selected, remote, books, start",
    [
        (1, None, False, [0], False, True, "forkserver"),  # shards to do: the server is forked before the books
        (1, None, False, [], False, True, "subprocess"),  # nothing to do: no server to fork
        (1, None, True, [], False, True, "forkserver"),  # run.overwrite replans, and will run workers
        (1, None, False, [0], True, True, "subprocess"),  # an object store's client is open: a fresh interpreter
        (2, "0", False, [0], False, True, "forkserver"),  # the first host keeps the books
        (2, "1", False, [], False, False, "forkserver"),  # any other host runs its workers, whatever its plan says
        (2, None, False, [0], False, True, "forkserver"),  # no NODE_RANK: torch's default rank 0, as the preflight's
    ],
)
def test_the_first_host_keeps_the_books_and_the_workers_server_is_forked_only_where_workers_will_run(
    nodes, node_rank, overwrite, selected, remote, books, start, monkeypatch
):
    """launch.py: on a job over several hosts the first host's launcher (NODE_RANK 0, or none set, as the preflight
    and the hosts' agreement read it; a job of one host is its own first) keeps the books, the others only run their
    workers. The workers' server is forked early only where
    workers will run (a host other than the first always runs its share; the first where run.overwrite replans or
    the plan selects shards) and only where this process has opened no object store's client (a fork would copy
    its half-alive threads): else "subprocess", where nothing is forked early."""
    import contextlib
    from types import SimpleNamespace as NS

    import launcher.host.agreement
    import launcher.host.worker_start
    import launcher.ledger.store
    from launcher.host import launch

    if node_rank is None:
        monkeypatch.delenv("NODE_RANK", raising=False)
    else:
        monkeypatch.setenv("NODE_RANK", node_rank)
    monkeypatch.setitem(launcher.ledger.store._OPENED, "remote", remote)
    seen = []

    @contextlib.contextmanager
    def forked_early(how):
        seen.append(("server", how))
        yield

    @contextlib.contextmanager
    def agree(cfg):
        seen.append(("agree", cfg.mesh.nodes))
        yield

    monkeypatch.setattr(launcher.host.worker_start, "server_forked_early", forked_early)
    monkeypatch.setattr(launcher.host.agreement, "hosts_agree", agree)
    monkeypatch.setattr(launch, "keep_books", lambda pf, conf, overrides, plan_: seen.append(("books", conf)) or 5)
    monkeypatch.setattr(
        launch, "run_hosts", lambda cfg, plan_, logs=None: seen.append(("workers", cfg.mesh.nodes)) or 6
    )
    cfg = launch_cfg(nodes=nodes)
    cfg.run = {"overwrite": overwrite}
    pf = NS(cfg=cfg, plan=NS(selected=selected))
    code = launch.supervise(pf, "tiny", [], launch.LaunchPlan(start="forkserver"))
    assert seen == [("server", start), ("agree", nodes), ("books", "tiny") if books else ("workers", nodes)]
    assert code == (5 if books else 6)


def test_a_row_set_aside_for_its_size_stays_aside_in_the_runs_plan_and_its_rejected_file_is_named_for_the_run(
    launcher_main, tiny_model, tmp_path, capsys, monkeypatch
):
    """DESIGN, `dataset.bad_rows=skip`: a row of a size the model cannot make is set aside at planning, and the run
    writes the rows it set aside to rejected/<run id>.parquet. The run's plan file (what the workers generate) is
    written under the same size rule, so it holds the good rows only and the run does not stop as if its source had
    changed; so is the plan that run.overwrite makes again. The workers are stood in for: each run marks its one
    shard done, as they would."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from launcher.host import launch
    from launcher.host.worker_start import START_ENV

    monkeypatch.setenv(START_ENV, "subprocess")  # no workers' server forked for a stand-in
    src, out = tmp_path / "p.jsonl", tmp_path / "out"
    rows = [{"prompt": "a"}, {"prompt": "b", "height": 65}, {"prompt": "c"}]  # 65: no size factor divides it
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = []

    def workers(cfg, plan_, logs=None):
        run_id = os.environ["MESHGEN_RUN_ID"]
        with pa.OSFile(str(out / "plans" / f"{run_id}.arrow")) as f:
            table = pa.ipc.open_file(f).read_all()
        fingerprint = json.loads(table.schema.metadata[b"meshgen_plan"])["shards"][0][1]
        runs.append((run_id, table.column("prompt").to_pylist()))
        (out / "state").mkdir(exist_ok=True)
        done = {"status": "done", "rows": 2, "run_id": run_id, "prompts_fingerprint": fingerprint, "files": {}}
        (out / "state" / "shard-00000.json").write_text(json.dumps(done))
        return 0

    monkeypatch.setattr(launch, "run_hosts", workers)
    job = ["conf=tiny", f"model.path={tiny_model}", f"output.dir={out}", f"dataset.path={src}", "dataset.bad_rows=skip"]
    assert launcher_main(job) == 0, capsys.readouterr().err[-2000:]
    [(run_id, prompts)] = runs
    assert prompts == ["a", "c"]
    [rejected] = pq.read_table(out / "rejected" / f"{run_id}.parquet").to_pylist()
    assert rejected["position"] == 1 and rejected["line"] == 2 and "height 65" in rejected["reason"]
    assert launcher_main([*job, "run.overwrite=true"]) == 0, capsys.readouterr().err[-2000:]
    assert len(runs) == 2 and runs[1][1] == ["a", "c"]


def test_run_stale_keep_over_an_id_column_records_which_ids_changed_in_the_kept_shards_state(
    launcher_main, tiny_model, tmp_path, capsys, monkeypatch
):
    """launcher/plan/stale.py: run.stale=keep marks each kept shard's state done for the new prompts and, with
    dataset.id_column, names the ids whose rows changed (`kept_ids`: status, report and the card show them). A
    shard of ids r0..r2 is generated (the workers stood in for: they mark it done), then r1's prompt changes."""
    import pyarrow as pa

    from launcher.host import launch
    from launcher.host.worker_start import START_ENV

    monkeypatch.setenv(START_ENV, "subprocess")
    src, out = tmp_path / "p.jsonl", tmp_path / "out"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"prompt {i}"}) + "\n" for i in range(3)))

    def workers(cfg, plan_, logs=None):
        run_id = os.environ["MESHGEN_RUN_ID"]
        with pa.OSFile(str(out / "plans" / f"{run_id}.arrow")) as f:
            fingerprint = json.loads(pa.ipc.open_file(f).schema.metadata[b"meshgen_plan"])["shards"][0][1]
        (out / "state").mkdir(exist_ok=True)
        done = {"status": "done", "rows": 3, "run_id": run_id, "prompts_fingerprint": fingerprint, "files": {}}
        (out / "state" / "shard-00000.json").write_text(json.dumps(done))
        return 0

    monkeypatch.setattr(launch, "run_hosts", workers)
    job = ["conf=tiny", f"model.path={tiny_model}", f"output.dir={out}", f"dataset.path={src}", "dataset.id_column=id"]
    assert launcher_main(job) == 0, capsys.readouterr().err[-2000:]
    rows = [
        {"id": "r0", "prompt": "prompt 0"},
        {"id": "r1", "prompt": "another prompt"},
        {"id": "r2", "prompt": "prompt 2"},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert launcher_main([*job, "run.stale=keep"]) == 0, capsys.readouterr().err[-2000:]
    state = json.loads((out / "state" / "shard-00000.json").read_text())
    assert state["status"] == "done" and state["kept_ids"] == ["r1"]


# open survivors, session 27


@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            {},
            "error: mesh.nodes=2 needs NODE_RANK, this host's place among them (0 to 1), and it is not set: set "
            "NODE_RANK and MASTER_ADDR on every host as the scheduler's recipes do (docs/operations.md)",
        ),
        ({"NODE_RANK": "2"}, "error: NODE_RANK='2' is not a host of mesh.nodes=2: set it to this host's place, 0 to 1"),
        (
            {"NODE_RANK": "first"},
            "error: NODE_RANK='first' is not a host of mesh.nodes=2: set it to this host's place, 0 to 1",
        ),
        (
            {"NODE_RANK": "1"},
            "error: mesh.nodes=2 needs MASTER_ADDR, the first host's address, and it is not set: set it to the "
            "address of the host with NODE_RANK=0, the same on every host",
        ),
    ],
)
def test_a_job_over_several_hosts_without_this_hosts_rank_or_the_first_hosts_address_is_one_line_up_front(
    env, line, launcher_main, tiny_model, tmp_path, capsys, monkeypatch
):
    """README: several hosts are `mesh.nodes=2` with NODE_RANK and MASTER_ADDR (docs/operations.md: the scheduler
    sets them). A launcher started without this host's rank (0 to nodes - 1), or without the first host's address,
    is bad configuration: exit 2, one line naming the variable and how to set it, before anything is written (it
    would otherwise take the first host's books, or hand torchrun a rank it refuses once the run has begun). A dry
    run may check a job for other hosts: it says the variables as the shell will read them."""
    for var in ("NODE_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    out = tmp_path / "out"
    args = ["conf=tiny", f"model.path={tiny_model}", f"output.dir={out}", "mesh.nodes=2", "mesh.dp=2", "mesh.tp=1"]
    assert launcher_main(args) == 2
    said = capsys.readouterr()
    assert said.err.strip().splitlines()[-1] == line and "error" not in said.out
    assert not out.exists()
    assert launcher_main(["--dry-run", *args]) == 0, capsys.readouterr().err[-2000:]
    [torchrun] = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("torchrun ")]
    assert "'--master-addr=$MASTER_ADDR'" in torchrun


@pytest.mark.parametrize(
    ("nodes", "rank", "overwrite", "selected", "remote", "start", "books"),
    [
        (1, None, False, [0], False, "forkserver", True),
        (1, None, False, [], False, "subprocess", True),  # nothing to generate: no worker starts
        (1, None, True, [], False, "forkserver", True),  # run.overwrite plans again, after the fork
        (2, "0", False, [0], False, "forkserver", True),
        (2, "0", False, [], False, "subprocess", True),
        (2, "1", False, None, False, "forkserver", False),  # another host: its workers always start
        (1, None, False, [0], True, "subprocess", True),  # an object store's client is open: a fresh server
        (2, "1", False, None, True, "subprocess", False),
    ],
)
def test_the_workers_server_is_forked_early_only_where_workers_start_and_no_store_client_is_open(
    nodes, rank, overwrite, selected, remote, start, books, monkeypatch
):
    """launcher/host/launch.py supervise: the workers' server is forked from the launcher before the books start
    their threads (launcher/host/worker_start.py), on a host whose workers will start (the first host with shards
    selected or run.overwrite, which plans again; every other host of a job, whose share the first host plans), and
    never from a launcher that has opened an object store's client (a fork would copy its threads half-alive). The
    first host keeps the books; the others only run their workers."""
    from contextlib import contextmanager, nullcontext
    from types import SimpleNamespace as NS

    import launcher.host.agreement
    import launcher.host.worker_start
    import launcher.ledger.store
    from launcher.host import launch

    monkeypatch.delenv("NODE_RANK", raising=False)
    if rank is not None:
        monkeypatch.setenv("NODE_RANK", rank)
    forked, ran = [], []

    @contextmanager
    def server_forked_early(how):
        forked.append(how)
        yield

    monkeypatch.setattr(launcher.host.worker_start, "server_forked_early", server_forked_early)
    monkeypatch.setattr(launcher.host.agreement, "hosts_agree", lambda cfg: nullcontext())
    monkeypatch.setattr(launcher.ledger.store, "opened_remote", lambda: remote)
    monkeypatch.setattr(launch, "keep_books", lambda pf, conf, overrides, plan_: ran.append("books") or 0)
    monkeypatch.setattr(launch, "run_hosts", lambda cfg, plan_, logs=None: ran.append("workers") or 0)
    cfg = OmegaConf.create({"mesh": {"nodes": nodes}, "run": {"overwrite": overwrite}})
    pf = NS(cfg=cfg, plan=None if selected is None else NS(selected=selected))
    assert launch.supervise(pf, "tiny", [], launch.LaunchPlan(start="forkserver")) == 0
    assert forked == [start] and ran == ["books" if books else "workers"]


def test_a_stale_shard_of_ids_kept_by_run_stale_keep_records_the_ids_whose_rows_changed(
    launcher_main, tiny_model, tmp_path, capsys, monkeypatch
):
    """docs/operations.md: with dataset.id_column, `run.stale=keep` keeps a stale shard's images and records the
    kept ids in its state file (`kept_fingerprint`, `kept_ids`): the ids whose rows changed. A shard of ids p1, p2,
    p3 made (workers stood in for), then p2's prompt changed: the kept shard's state names p2 alone; the same
    command without run.stale=keep then finds it done."""
    import pyarrow as pa

    from launcher.host import launch
    from launcher.host.worker_start import START_ENV

    monkeypatch.setenv(START_ENV, "subprocess")
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out"

    def write(b: str) -> None:
        rows = [{"key": "p1", "prompt": "a"}, {"key": "p2", "prompt": b}, {"key": "p3", "prompt": "c"}]
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def workers(cfg, plan_, logs=None):
        run_id = os.environ["MESHGEN_RUN_ID"]
        with pa.OSFile(str(out / "plans" / f"{run_id}.arrow")) as f:
            table = pa.ipc.open_file(f).read_all()
        fingerprint = json.loads(table.schema.metadata[b"meshgen_plan"])["shards"][0][1]
        (out / "state").mkdir(exist_ok=True)
        done = {"status": "done", "rows": 3, "run_id": run_id, "prompts_fingerprint": fingerprint, "files": {}}
        (out / "state" / "shard-00000.json").write_text(json.dumps(done))
        return 0

    monkeypatch.setattr(launch, "run_hosts", workers)
    write("b")
    args = ["conf=tiny", f"model.path={tiny_model}", f"output.dir={out}", f"dataset.path={prompts}"]
    args.append("dataset.id_column=key")
    assert launcher_main(args) == 0, capsys.readouterr().err[-2000:]
    write("b, changed")
    assert launcher_main([*args, "run.stale=keep"]) == 0, capsys.readouterr().err[-2000:]
    state = json.loads((out / "state" / "shard-00000.json").read_text())
    assert state["kept_ids"] == ["p2"] and "kept_fingerprint" in state
    assert launcher_main(args) == 0, capsys.readouterr().err[-2000:]


def test_a_run_whose_lock_was_taken_over_still_removes_its_own_plan_and_leaves_the_books_to_the_new_holder(
    launcher_main, tiny_model, tmp_path, capsys, monkeypatch
):
    """DESIGN: plans/<run id>.arrow is removed when the run ends. On an object store another launcher may take over
    the lock of a run that looked dead (launcher/ledger/lock.py: held() is then false); that run still removes its
    own plan as its workers end, while the folder's books (its ledger index, the card) and the other runs' leftover
    plans are the new holder's. Workers stood in for; the take-over happens while they run."""
    import launcher.ledger.lock
    from launcher.host import launch
    from launcher.host.worker_start import START_ENV

    monkeypatch.setenv(START_ENV, "subprocess")
    prompts, out = tmp_path / "p.txt", tmp_path / "out"
    prompts.write_text("a\nb\n")
    args = ["conf=tiny", f"model.path={tiny_model}", f"output.dir={out}", f"dataset.path={prompts}"]
    assert launcher_main([*args, "run.shards=failed"]) == 0, capsys.readouterr().err[-2000:]
    (out / "README.md").unlink()
    (out / "plans").mkdir()
    (out / "plans" / "19990101T000000-elsewhere-1.arrow").write_bytes(b"a dead run's plan")
    seen = []

    def workers(cfg, plan_, logs=None):
        run_id = os.environ["MESHGEN_RUN_ID"]
        seen.append((run_id, (out / "plans" / f"{run_id}.arrow").exists()))
        monkeypatch.setattr(launcher.ledger.lock.RunLock, "held", lambda self: False)  # taken over now
        return 3

    monkeypatch.setattr(launch, "run_hosts", workers)
    assert launcher_main(args) == 3
    [(run_id, planned)] = seen
    assert planned and not (out / "plans" / f"{run_id}.arrow").exists()
    assert (out / "plans" / "19990101T000000-elsewhere-1.arrow").exists()  # the new holder's to judge
    assert not (out / "README.md").exists() and (out / "runs" / f"{run_id}.json").exists()


@pytest.mark.parametrize(
    ("env", "refused"),
    [
        ({"TPU_WORKER_HOSTNAMES": "t0,t1"}, False),
        ({"JOB_COMPLETION_INDEX": "1"}, False),
        ({"TPU_WORKER_HOSTNAMES": "t0"}, True),  # one host: nothing for TorchTPU to derive a rank from
        ({}, True),
    ],
)
def test_a_tpu_slice_may_leave_the_hosts_rank_and_address_to_torchtpu(env, refused, monkeypatch):
    """FINDINGS.md: on a multi-host TPU slice, set_tpu_launch_env derives NODE_RANK and MASTER_ADDR from
    TPU_WORKER_HOSTNAMES (two or more names) or JOB_COMPLETION_INDEX; a job over several TPU hosts is then not refused
    for their absence. Without either, it is, as on any other device."""
    from launcher.checks.settings import check_host_env

    for var in ("NODE_RANK", "MASTER_ADDR", "TPU_WORKER_HOSTNAMES", "JOB_COMPLETION_INDEX"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    if refused:
        with pytest.raises(ConfigError, match="^mesh.nodes=2 needs NODE_RANK"):
            check_host_env(2, "tpu")
    else:
        check_host_env(2, "tpu")
    with pytest.raises(ConfigError, match="^mesh.nodes=2 needs NODE_RANK"):
        check_host_env(2, "cuda")  # the same variables mean nothing off a TPU


# host room, part rest (second): the workers' server forked early (launcher/host/worker_start.py's _serve) and the
# refusal of an unknown way to start workers.


def _report_from_a_worker(path):
    """A forkserver worker's target: what it was started with, written where the test reads it."""
    import signal
    import sys

    seen = {
        "late": os.environ.get("MESHGEN_TEST_SET_AFTER_THE_FORK"),
        "parent": os.getppid(),
        "preloaded": "tabnanny" in sys.modules,
        "sigint_raises": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    }
    Path(path).write_text(json.dumps(seen))


def test_the_workers_server_forked_early_serves_what_it_is_sent_and_ends_without_returning_to_the_launcher(
    tmp_path, monkeypatch
):
    """worker_start.py: the server forked from the launcher waits for the environment the launcher completes later
    (here a variable set after the fork), then is multiprocessing's forkserver with PRELOAD imported: each worker
    forks from it (its parent), sees that environment, the preloaded modules and a fresh interpreter's Ctrl-C
    (KeyboardInterrupt). Ended before it is handed over
    (nothing to generate), the server exits: `_serve` never returns, so no copy of the launcher goes on running its
    caller's code. PRELOAD is a module this process has not imported (launcher.worker.preload costs seconds); the
    session's other threads (servers of earlier tests) are not this test's: the server is forked all the same."""
    import multiprocessing
    import sys
    import threading

    import psutil

    import launcher.host.worker_start as worker_start

    assert "tabnanny" not in sys.modules
    monkeypatch.setattr(worker_start, "PRELOAD", ["tabnanny"])
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    forkserver = multiprocessing.forkserver._forkserver
    monkeypatch.setattr(forkserver, "_preload_modules", forkserver._preload_modules)
    monkeypatch.delenv("MESHGEN_TEST_SET_AFTER_THE_FORK", raising=False)
    launcher, escaped = os.getpid(), tmp_path / "escaped"

    try:
        with worker_start.server_forked_early("forkserver"):
            server = worker_start._early["pid"]
    finally:
        if os.getpid() != launcher:  # the server, gone on into this test's code
            escaped.write_text("")
            os._exit(0)
    assert not escaped.exists() and not psutil.pid_exists(server)

    report = tmp_path / "worker.json"
    with worker_start.server_forked_early("forkserver"):
        server = worker_start._early["pid"]
        monkeypatch.setenv("MESHGEN_TEST_SET_AFTER_THE_FORK", "yes")
        with worker_start.preloaded_forkserver():
            worker = multiprocessing.get_context("forkserver").Process(target=_report_from_a_worker, args=(report,))
            worker.start()
            worker.join(timeout=30)
    assert worker.exitcode == 0
    assert json.loads(report.read_text()) == {"late": "yes", "parent": server, "preloaded": True, "sigint_raises": True}


def test_an_unknown_way_to_start_workers_is_refused_naming_the_value_and_the_ways(monkeypatch):
    """DESIGN: an error names what is wrong. MESHGEN_WORKER_START takes `subprocess` or `forkserver`."""
    from launcher.host.worker_start import START_ENV, start_method

    monkeypatch.setenv(START_ENV, "spawn")
    with pytest.raises(ConfigError) as refused:
        start_method("cpu", 1)
    assert (
        str(refused.value)
        == "MESHGEN_WORKER_START='spawn' is not a way to start workers; use one of subprocess, forkserver"
    )


def test_a_workers_line_reaches_the_terminal_as_its_file_has_it(capsys):
    """terminal.py: the tailers hand each kept line, with its newline, to tqdm.write, which prints it above the bar
    and ends it itself: the line is printed as the worker wrote it, only the newline not doubled."""
    from launcher.host.terminal import _BarSafe

    lines = ["[rank1] 12:00:00 WARNING launcher.worker.lora: no layer matches the keys of style-X", "  indented\t "]
    for line in lines:
        _BarSafe().write(f"{line}\n")
    assert capsys.readouterr().err == "".join(f"{line}\n" for line in lines)


@pytest.mark.parametrize("verbose", ["1", None])
def test_meshgen_verbose_1_shows_every_workers_line_on_the_terminal(verbose, tmp_path, capsys, monkeypatch):
    """terminal.py: MESHGEN_VERBOSE=1 shows every line of every rank; without it a routine line stays in the file."""
    from launcher.host.terminal import WorkerLogs
    from launcher.ledger.store import Store

    if verbose is None:
        monkeypatch.delenv("MESHGEN_VERBOSE", raising=False)
    else:
        monkeypatch.setenv("MESHGEN_VERBOSE", verbose)
    routine = "[rank0] 12:00:00 INFO launcher.worker.runner: a routine line"
    with WorkerLogs(Store(str(tmp_path / "out")), "run-1") as logs:
        dest = logs.specs.reify({0: {"RANK": "0"}})
        capsys.readouterr()
        Path(dest.stderrs[0]).write_text(f"{routine}\n")
    assert capsys.readouterr().err.splitlines() == ([routine] if verbose else [])


def test_the_worker_logs_of_a_bucket_are_written_in_the_temporary_folder_and_leave_nothing_here(tmp_path, monkeypatch):
    """terminal.py: on an object store the files are written locally and uploaded at the end: in the temporary
    folder (TMPDIR), never in the working folder under the bucket's path, and removed once uploaded. The bucket is
    stood in for."""
    import tempfile
    from types import SimpleNamespace as NS

    from launcher.host.terminal import WorkerLogs

    uploaded = {}
    bucket = NS(
        is_local=False,
        path=lambda rel: f"a-bucket/run/{rel}",
        url=lambda rel: f"s3://a-bucket/run/{rel}",
        write_bytes=uploaded.__setitem__,
    )
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    with WorkerLogs(bucket, "run-2", verbose=False) as logs:
        assert logs.folder.resolve().is_relative_to(Path(tempfile.gettempdir()).resolve())
        Path(logs.specs.reify({0: {"RANK": "1"}}).stderrs[0]).write_text("a line\n")
    assert uploaded["logs/run-2/rank-1.log"] == b"a line\n"
    assert not logs.folder.exists() and list(here.iterdir()) == []


@pytest.mark.parametrize("local", [True, False])
def test_the_progress_bar_looks_at_a_local_output_each_second_and_at_an_object_store_every_ten(local):
    """summary.py Progress: each look lists the output's states (one listing: requests, on an object store); a
    local folder is looked at once a second, an object store every 10 s. In 1.8 s: one look or more here, none
    there, until the end's own look. The ledger is stood in for."""
    import time
    from types import SimpleNamespace as NS

    from launcher.host.summary import Progress

    looks = []
    ledger = NS(store=NS(is_local=local), refresh=lambda: looks.append(1) or {})
    with Progress(ledger, 10, "r"):
        time.sleep(1.8)
        seen = len(looks)
    assert (seen >= 1) if local else (seen == 0)
    assert len(looks) == seen + 1


def test_a_runs_record_and_summary_name_its_failed_shard_its_held_one_and_how_to_finish(tmp_path, monkeypatch):
    """summary.py: a selected shard that failed makes the run 3 and the summary's `not done:` line says how to
    finish (the same command), though no shard is pending; a shard held after run.max_attempts failures is the
    record's `not_retried` and has its line, which names no samples and no words its state lacks. The record's
    run time and start-up are to the hundredth of a second (the wall clock is stood in for: 12.3456 s of run,
    the first shard began 1.2345 s after the launch)."""
    import time
    from types import SimpleNamespace as NS

    from launcher.host import summary
    from launcher.ledger.store import Store

    end = 1_700_000_000.0
    clock = NS(monotonic=lambda: 112.3456, time=lambda: end, strftime=time.strftime, localtime=time.localtime)
    monkeypatch.setattr(summary, "time", clock)
    states = {
        0: {"status": "done", "rows": 4, "run_id": "r", "prompts_fingerprint": "f0", "started_at": end - 11.1111},
        1: {"status": "failed", "run_id": "r", "error_class": "OSError", "error": "OSError: gone"},
        3: {"status": "failed", "attempts": 3, "error_class": "ValueError", "error": None, "samples": None},
    }
    shards = [NS(index=i, status="pending", fingerprint=f"f{i}", seen=None) for i in range(4)]
    plan = NS(shards=shards, selected=[0, 1], held=[3], rejected=[])
    rerun = ["launch.sh", "conf=tiny"]
    lines, record = summary.summarize(Store(str(tmp_path)), NS(refresh=lambda: states), plan, "r", 100.0, 0, rerun)
    assert record["exit_code"] == 3
    assert record["not_done"] == {"failed": [1], "pending": [], "held_by_other_runs": [], "not_retried": [3]}
    assert record["seconds"] == 12.35 and record["startup_s"] == 1.23
    assert lines[-2:] == [
        "not retried: shards [3] failed 3 times in a row with the same error (shard 3: ValueError: ); a rerun fails "
        "them again: fix the row(s), then run launch.sh conf=tiny run.shards=failed",
        "not done: failed shards [1]; finish them with the same command: launch.sh conf=tiny",
    ]


def test_a_summarys_list_of_shards_names_twenty_and_then_how_many_in_all():
    from launcher.host.summary import _short

    assert _short(list(range(20))) == str(list(range(20)))
    assert _short(list(range(21))) == f"{str(list(range(20)))[:-1]}, ... (21 in all)]"


def test_the_run_record_names_the_checkout_the_code_is_in_and_a_git_that_hangs_costs_at_most_its_bound(
    tmp_path, monkeypatch
):
    """The record's `code`: `git describe --always --dirty` of the checkout holding launcher/ (not of a folder
    above it); a git that never answers (a hung network file system) leaves it None within its bound (5 s; 0.2 s
    here)."""
    import subprocess
    import threading

    from launcher.host import summary

    checkout = tmp_path / "checkout"
    (checkout / "launcher" / "host").mkdir(parents=True)
    (checkout / "launcher" / "host" / "summary.py").write_text("")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(summary, "__file__", str(checkout / "launcher" / "host" / "summary.py"))
    assert head and summary.code_version() == head

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "git").write_text("#!/bin/sh\nexec sleep 30\n")
    (bin_ / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(summary, "GIT_TIMEOUT_S", 0.2)
    found = []
    asking = threading.Thread(target=lambda: found.append(summary.code_version()), daemon=True)
    asking.start()
    asking.join(timeout=15)
    assert found == [None]


# --- host room, part rest: the hosts' agreement and watch, and the metrics textfile
# (launcher/host/{agreement,metrics,peers}.py).


def test_a_difference_names_values_of_40_characters_whole_and_counts_only_the_keys_past_8():
    """agreement.py's words: a value past 40 characters is cut to 12 and "...", one of 40 is named whole; at most 8
    keys are named and "and N more" follows only where more differ; each host's line is joined to the next by "; "."""
    from launcher.host.agreement import differences

    assert differences({"k": "x" * 40}, {"k": "y" * 40}) == f"k {'x' * 40} != {'y' * 40}"
    assert differences({"k": "x" * 41}, {"k": "y" * 41}) == f"k {'x' * 12}... != {'y' * 12}..."
    eight = {f"k{i}": i for i in range(8)}
    said = differences({k: -1 for k in eight}, eight)
    assert said.endswith("k7 -1 != 7") and "more" not in said
    job = {"generate.seed": 1}
    line = (
        "host 1's settings differ from host 0's: generate.seed 2 != 1; host 2's settings differ from host 0's: "
        "generate.seed 3 != 1; start every host with the same job"
    )
    assert agree_all([job, {"generate.seed": 2}, {"generate.seed": 3}]) == [line] * 3


def test_the_first_host_keeps_its_store_up_until_every_host_has_read_a_difference():
    """agreement.py: the others read host 0's job through host 0's store, so on a difference host 0 raises only once
    every host has compared (or READ_FOR_S passed); a host that ended at once would leave the others a store that
    stopped answering instead of the difference's line."""
    import threading
    import time

    from torch.distributed import HashStore

    from launcher.host.agreement import agree
    from launcher.host.peers import key

    store, said = HashStore(), []
    store.set(key(1, "job"), json.dumps({"generate.seed": 2}))  # host 1 published its job, and has not compared yet

    def first() -> None:
        with pytest.raises(ConfigError) as e:
            agree(store, 0, 2, {"generate.seed": 1})
        said.append(str(e.value))

    t = threading.Thread(target=first)
    t.start()
    time.sleep(0.6)
    assert t.is_alive() and not said  # waits for host 1
    store.set(key(1, "compared"), "1")
    t.join(timeout=10)
    assert said == ["host 1's settings differ from host 0's: generate.seed 2 != 1; start every host with the same job"]


def test_the_job_the_hosts_compare_holds_every_setting_of_the_quality_run_execution_and_job_groups():
    """agreement.py's words: not fingerprinted, but each host's workers write with their own: the scores (quality),
    the rows read, the execution, the job; a host started with another of them differs."""
    from launcher.config import load_config
    from launcher.host.agreement import job_of

    base = job_of(load_config("tiny"))
    other = job_of(
        load_config("tiny", ["quality.clip_score=true", "run.max_attempts=5", "execution.release_text_encoder=false"])
    )
    assert {k for k in base if base[k] != other.get(k)} == {
        "config.quality.clip_score",
        "config.run.max_attempts",
        "config.execution.release_text_encoder",
    }
    assert base["config.job"] == "text_to_image"


def test_the_runs_numbers_keep_milliseconds_and_hundredths_of_the_run_and_a_rate_under_a_second():
    """metrics.py's numbers as the run record and the textfile give them: seconds summed to the millisecond from
    states that keep 4 decimals (runner.py), the rate to 3 decimals, the run's seconds to hundredths; a run of half a
    second has a rate."""
    from launcher.host.metrics import numbers

    ours = {
        0: {"status": "done", "rows": 10, "seconds": 1.1111, "stages": {"denoise": 0.1111}},
        1: {"status": "failed", "rows": 2, "seconds": 2.2222, "stages": {"denoise": 0.2222}},
    }
    got = numbers(ours, 2.3456)
    assert (got["shard_seconds_sum"], got["stage_seconds"], got["run_seconds"]) == (3.333, {"denoise": 0.333}, 2.35)
    assert got["images_per_second"] == 4.263  # 10 / 2.3456 = 4.26330...
    assert numbers(ours, 0.5)["images_per_second"] == 20.0


def test_the_textfile_makes_its_folders_and_says_when_it_was_written_to_the_millisecond(tmp_path, monkeypatch):
    """metrics.py: `meshgen_last_update_timestamp_seconds`, when this file was written (Unix time); PATH's folders are
    made as needed."""
    import time
    from types import SimpleNamespace

    from launcher.host import metrics

    monkeypatch.setattr(metrics, "time", SimpleNamespace(time=lambda: 1_700_000_000.123456, monotonic=time.monotonic))
    path = tmp_path / "a" / "b" / "meshgen.prom"
    metrics.write_textfile(path, "/out", "r1", metrics.numbers({}, 1.0), 4)
    lines = path.read_text().splitlines()
    assert 'meshgen_last_update_timestamp_seconds{output="/out",run_id="r1"} 1700000000.123' in lines
    assert "# TYPE meshgen_last_update_timestamp_seconds gauge" in lines


def test_output_metrics_plans_every_image_of_the_selected_prompts_and_labels_them_with_the_output(tmp_path):
    """metrics.py: output.metrics's file is written at the start, its samples planned = the selected shards' prompts
    x images_per_prompt x the sweep's variants, labelled with the output; no file where output.metrics is unset."""
    from launcher.host.metrics import metrics_file
    from launcher.plan.plan import Plan, ShardPlan

    shards = [ShardPlan(0, 2, "a", "pending"), ShardPlan(1, 3, "b", "pending"), ShardPlan(2, 4, "c", "done")]
    plan = Plan(shards, [0, 1], [])  # shards 0 and 1 selected: 5 prompts
    gen = {"images_per_prompt": 2, "sweep": {"guidance_scale": [1.0, 2.0, 3.0]}}
    path = tmp_path / "meshgen.prom"
    cfg = OmegaConf.create({"output": {"metrics": str(path)}, "generate": gen})
    assert metrics_file(cfg, "/data/out", plan, "r1", 0.0) is not None
    assert 'meshgen_samples_planned{output="/data/out",run_id="r1"} 30' in path.read_text().splitlines()  # 5 x 2 x 3
    assert metrics_file(OmegaConf.create({"output": {"metrics": ""}, "generate": gen}), "/o", plan, "r", 0.0) is None


def test_a_hosts_watch_reads_every_other_host_also_past_one_that_said_bye(quick_peers):
    """peers.py: a host that said `bye` ended; the hosts after it in the watch's round are still read each beat, so
    one that beats on is never taken for lost."""
    import time

    peers, port = quick_peers
    with peers.PeerWatch(0, 3, "127.0.0.1", port) as first, peers.PeerWatch(2, 3, "127.0.0.1", port):
        second = peers.PeerWatch(1, 3, "127.0.0.1", port).__enter__()
        until(lambda: {1, 2} <= set(first._seen))
        second.__exit__(None, None, None)  # host 1 ends: says bye; host 2 beats on
        until(lambda: 1 in first._said_bye)
        time.sleep(2 * peers.LOST_AFTER_S)
        assert first.lost is None and 2 in first._seen


def test_a_host_rides_out_one_failed_store_call_and_names_the_error_of_a_store_that_stays_down(
    quick_peers, monkeypatch
):
    """peers.py: the first host is lost when its store stays unreachable for LOST_AFTER_S, not at one call that
    fails; the loss names the error the store calls raise."""
    import time

    from torch.distributed import TCPStore

    peers, port = quick_peers
    served = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True)  # host 0's
    failing = {"calls": 0}

    class Flaky:
        """The first host's store, whose calls fail while failing["calls"] > 0 (each failure counts one down)."""

        def __init__(self, store):
            self.store = store

        def __getattr__(self, name):
            def call(*args):
                if failing["calls"] > 0:
                    failing["calls"] -= 1
                    raise ConnectionResetError("the store went away")
                return getattr(self.store, name)(*args)

            return call

    real = peers.connect
    monkeypatch.setattr(peers, "connect", lambda *a: Flaky(real(*a)))
    with peers.PeerWatch(1, 2, "127.0.0.1", port) as second:
        until(lambda: second._store is not None)
        failing["calls"] = 1
        until(lambda: failing["calls"] == 0)
        time.sleep(0.3)  # beats go on after the one failure
        assert second.lost is None
        failing["calls"] = 10**9
        until(lambda: second.lost is not None)
    assert second.lost == f"the first host (127.0.0.1:{port}) stopped answering (ConnectionResetError)"
    del served


def test_a_host_started_before_the_first_waits_for_its_store(quick_peers):
    """peers.py: a host waits up to CONNECT_FOR_S (900 s, torch's own join timeout) for the first host's store."""
    import time

    peers, port = quick_peers
    with peers.PeerWatch(1, 2, "127.0.0.1", port) as second:
        time.sleep(1.0)  # several tries find nothing yet
        with peers.PeerWatch(0, 2, "127.0.0.1", port):
            until(lambda: 0 in second._seen)
        assert second.lost is None


def test_the_first_hosts_watch_serves_through_the_store_the_agreement_already_serves(quick_peers):
    """agreement.py and peers.py: the first host's agreement serves the job's store on MASTER_PORT and keeps it up
    while the watch (and torch's agent) start: the watch's server shares that port (multi-tenant)."""
    from torch.distributed import TCPStore

    peers, port = quick_peers
    agreement = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True)
    with peers.PeerWatch(0, 2, "127.0.0.1", port) as first, peers.PeerWatch(1, 2, "127.0.0.1", port):
        until(lambda: 1 in first._seen)
    assert agreement.add(peers.key(0, "beat"), 0) > 0


def test_a_try_to_reach_the_first_host_is_bounded_where_its_address_drops_connections():
    """peers.py's connect: polled with plain connects until `until`; a host whose SYNs go unanswered (here: a
    listener whose queue is full) costs each try its 2 s bound, not the system's minutes."""
    import socket
    import threading
    import time

    from launcher.host.peers import connect

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port, held = listener.getsockname()[1], []
    for _ in range(4):  # fill its queue: the kernel drops the SYNs of later connects
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        held.append(s)
    got = []
    t = threading.Thread(target=lambda: got.append(connect("127.0.0.1", port, lambda: False, time.monotonic() + 0.2)))
    try:
        t.start()
        t.join(timeout=10)
        assert got == [None]
    finally:
        for s in (*held, listener):
            s.close()


def settled(monkeypatch, lost_after_s: float, feed=None, lose_at: float | None = None, lost: str | None = None):
    """PeerWatch.settle() of host 0 of 2, its watch played here: `feed(watch, t0)` runs beside it (filling `_seen`
    as the watch would), the loss shows `lose_at` s after the call; (what settle said, its seconds)."""
    import threading
    import time

    from launcher.host import peers

    monkeypatch.setattr(peers, "HEARTBEAT_S", 0.5)
    monkeypatch.setattr(peers, "LOST_AFTER_S", lost_after_s)
    watch = peers.PeerWatch(0, 2, "127.0.0.1", 1)
    watch.lost = lost
    watch._seen[1] = (7, time.monotonic() - 0.5)  # its last beat, seen before the workers failed
    t0, stop = time.monotonic(), threading.Event()

    def play() -> None:
        if feed is not None:
            feed(watch, t0, stop)
        if lose_at is not None:
            time.sleep(max(0.0, t0 + lose_at - time.monotonic()))
            watch.lost = "host 1 (node rank 1) stopped answering"

    threading.Thread(target=play, daemon=True).start()
    said = watch.settle()
    stop.set()
    return said, time.monotonic() - t0


def test_settle_is_at_once_a_failure_of_ours_while_the_other_host_beats_on(monkeypatch):
    """peers.py's settle: every other host's beat seen to change twice since: alive, the failure was ours (None), as
    soon as that is seen, not at the deadline (LOST_AFTER_S + 2 beats)."""
    import time

    def beats(watch, t0, stop):
        value = 7
        while not stop.is_set():
            value += 1
            watch._seen[1] = (value, time.monotonic())
            time.sleep(0.02)

    said, seconds = settled(monkeypatch, 4.0, beats)
    assert said is None and seconds < 2.0


def test_settle_waits_for_a_silent_host_to_be_lost_even_past_lost_after_s(monkeypatch):
    """peers.py's settle: a host that does not beat is lost by the watch within LOST_AFTER_S, which settle waits for
    (up to LOST_AFTER_S + 2 beats); a host seen to beat only once more may be the last beat of one that just died,
    so that is no answer yet either; a loss already seen is said at once."""
    import time

    said, _ = settled(monkeypatch, 1.0, lose_at=1.0)  # silent: lost after LOST_AFTER_S, before its 2 beats more
    assert said == "host 1 (node rank 1) stopped answering"

    def one_beat(watch, t0, stop):
        time.sleep(0.15)
        watch._seen[1] = (8, time.monotonic())

    said, _ = settled(monkeypatch, 1.0, one_beat, lose_at=0.8)
    assert said == "host 1 (node rank 1) stopped answering"
    said, seconds = settled(monkeypatch, 4.0, lost="host 1 (node rank 1) stopped answering")
    assert said == "host 1 (node rank 1) stopped answering" and seconds < 1.0


def test_a_loss_stops_the_workers_only_while_the_agent_runs_and_then_releases_the_agents_exit_barrier():
    """peers.py: a loss is this launcher's SIGTERM (the agent stops its workers) only inside agent(); before or after
    it the launcher acts on `lost` itself. The first loss is the one said, and none after the watch closed. With the
    SIGTERM, the agents' exit barrier (torch's, under torchrun's default rendezvous id) is released for the lost
    host, so a host whose workers are done stops waiting."""
    import signal
    import threading

    from torch.distributed import HashStore, PrefixStore
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils.store import barrier

    from launcher.host.peers import RDZV_ID, PeerWatch

    signals: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda sig, frame: signals.append(sig))
    try:
        watch = PeerWatch(0, 2, "127.0.0.1", 1)
        watch._store = HashStore()
        watch._lose("host 1 (node rank 1) stopped answering")
        assert watch.lost == "host 1 (node rank 1) stopped answering" and signals == []  # no agent yet
        watch.lost = None
        done = threading.Event()
        agent_store = PrefixStore(RDZV_ID, watch._store)  # this host's agent, its workers done, waits for the other
        waiting = threading.Thread(
            target=lambda: (barrier(agent_store, 2, _TERMINAL_STATE_SYNC_ID, barrier_timeout=20), done.set())
        )
        waiting.start()
        with watch.agent():
            watch._lose("host 1 (node rank 1) stopped answering")
            watch._lose("the first host (127.0.0.1:1) stopped answering (DistNetworkError)")
        waiting.join(timeout=10)
        assert signals == [signal.SIGTERM] and done.is_set()
        assert watch.lost == "host 1 (node rank 1) stopped answering"
        closed = PeerWatch(1, 2, "127.0.0.1", 1)
        closed.__exit__(None, None, None)
        closed._lose("the first host's store (127.0.0.1:1) never answered")
        assert closed.lost is None
    finally:
        signal.signal(signal.SIGTERM, old)
