"""Fast known-answer tests of promises that only slow end-to-end runs checked before: each sample's seed inside a
batch of several prompts and images, the prompt limit in bytes (both readers), a done shard whose prompts changed,
a dry run on a host that has chips, and the tp ranks' comparison of their images under step caching (the end-to-end
one: tests/test_speed.py). Expected values come from DESIGN.md's words, worked out here."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
from conftest import PROMPTS, contract_seed
from omegaconf import OmegaConf

from launcher.config import load_config
from launcher.errors import ConfigError


def test_each_sample_of_a_batch_of_several_prompts_and_images_gets_its_own_seed():
    """batch_size 3 and 2 images per prompt, rows with and without a `seed` column: every sample's seed (the
    Parquet's `seed` column) and the image it was made with, by sample id. With batch_size 1 a wrong index into a
    batch's seeds gives the same answer; here it does not."""
    from jobs.text_to_image import make_batches

    gen = OmegaConf.create(
        {"height": 64, "width": 64, "num_inference_steps": 4, "guidance_scale": 1.0, "batch_size": 3, "seed": 7}
    )
    gen.images_per_prompt = n = 2
    rows = [
        {"id": "a", "prompt": "p"},
        {"id": "b", "prompt": "q", "seed": 11},
        {"id": "c", "prompt": "r"},
        {"id": "d", "prompt": "s", "seed": 2**63 - 1},
    ]
    # DESIGN.md: sha256("<generate.seed>:<sample id>"); the README: a row's own seed seeds its N images as a job
    # seed would, sample k from sha256("<row seed>:<k>").
    want = {f"{r['id']}-{k}": contract_seed(7, f"{r['id']}-{k}") for r in rows for k in range(n)}
    want |= {f"{r['id']}-{k}": contract_seed(r["seed"], str(k)) for r in rows if "seed" in r for k in range(n)}
    batches = make_batches(rows, gen)
    assert [(b.n_real, len(b.rows)) for b in batches] == [(3, 3), (1, 3)]
    got = {}
    for b in batches:
        ids = [f"{r['id']}-{k}" for r in b.rows for k in range(n)]  # the pipeline's order: prompt-major
        assert b.seeds == [want[i] for i in ids]  # the generators, one per image, padding included
        images = [np.full((2, 2, 3), j / 255) for j in range(len(ids))]  # image j is level j all over
        for s in b.samples(images):
            got[s["id"]] = (s["seed"], s["prompt_id"], int(s["pixels"][0, 0, 0]))
        assert [got[i][2] for i in ids[: b.n_real * n]] == list(range(b.n_real * n))  # each its own image
    assert {i: g[:2] for i, g in got.items()} == {i: (want[i], i[0]) for i in want}


@pytest.fixture
def long_prompts(tmp_path):
    """Prompts of 30,000 and 40,000 'é': 60,000 bytes of UTF-8 (within the 64 KiB limit), and 80,000 (over it,
    though 40,000 characters are not), as a .txt line and as a .jsonl prompt and negative prompt."""

    def write(chars: int, kind: str):
        text = "é" * chars
        if kind == "txt":
            path = tmp_path / f"{chars}.txt"
            path.write_text(text + "\n", encoding="utf-8")
        elif kind == "prompt":
            path = tmp_path / f"{chars}.jsonl"
            path.write_text(json.dumps({"prompt": text}) + "\n", encoding="utf-8")
        else:
            path = tmp_path / f"{chars}-negative.jsonl"
            path.write_text(json.dumps({"prompt": "fine", "negative_prompt": text}) + "\n", encoding="utf-8")
        return str(path), text

    return write


@pytest.mark.parametrize("kind", ["txt", "prompt", "negative"])
def test_the_prompt_limit_counts_bytes_in_both_readers(long_prompts, kind):
    from launcher.sources.prompts import Source, _exact_rows, _GiveUp, read_batches
    from launcher.sources.prompts_fast import fast_batches

    column = "negative_prompt" if kind == "negative" else "prompt"
    path, text = long_prompts(30_000, kind)
    [fast] = [r for b in fast_batches(path, Source(path), 0) for r in b.to_pylist()]  # fast: certainly fine
    [exact] = list(_exact_rows(path, Source(path), 0))
    assert fast[column] == exact[column] == text
    assert [r[column] for b in read_batches(Source(path)) for r in b.to_pylist()] == [text]

    path, _ = long_prompts(40_000, kind)
    with pytest.raises(_GiveUp):  # the fast reader leaves it to the exact one, which names the line
        list(fast_batches(path, Source(path), 0))
    for rows in (lambda: list(_exact_rows(path, Source(path), 0)), lambda: list(read_batches(Source(path)))):
        with pytest.raises(ConfigError) as e:
            rows()
        assert f"{path}, line 1" in str(e.value) and "80000 bytes" in str(e.value), str(e.value)


def test_a_done_shard_whose_prompts_changed_is_stale(tmp_path):
    """Shards of 2 prompts, both done; one prompt of shard 0 edited: shard 0 is stale (refused by default,
    regenerated with run.stale=regenerate), shard 1 is still done."""
    from launcher.plan.plan import make_plan

    src = tmp_path / "p.txt"
    src.write_text("a red cat\na blue dog\na green tree\na grey sky\n")
    cfg = load_config("tiny", [f"dataset.path={src}", "run.shard_size=2"])
    first = make_plan(cfg, {})
    assert first.status == {0: "pending", 1: "pending"}
    done = {s.index: {"status": "done", "rows": 2, "prompts_fingerprint": s.fingerprint} for s in first.shards}
    assert make_plan(cfg, done).status == {0: "done", 1: "done"} and make_plan(cfg, done).selected == []

    src.write_text("a red cat\na blue wolf\na green tree\na grey sky\n")
    with pytest.raises(ConfigError, match=r"shards \[0\] are done but their prompts changed"):
        make_plan(cfg, done)
    plan = make_plan(load_config("tiny", [f"dataset.path={src}", "run.shard_size=2", "run.stale=regenerate"]), done)
    assert (plan.status, plan.stale, plan.selected) == ({0: "stale", 1: "done"}, [0], [0])


def test_a_dry_run_on_a_host_with_chips_checks_their_count(launcher_main, default_model, monkeypatch, capsys):
    """A CUDA host with 4 chips, a job of 8 processes on it: the dry run exits 2 as the real run would, naming
    the count (CPU hosts never reach this check: they have no chip count)."""
    import launcher.checks.settings

    monkeypatch.setattr(launcher.checks.settings, "local_chip_count", lambda device: 4 if device == "cuda" else None)
    code = launcher_main(["--dry-run", PROMPTS, "device=cuda", "mesh.chip=h100", "mesh.dp=8", "mesh.tp=1"])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "8 processes per host but this host has 4 cuda chips" in err.strip().splitlines()[-1], err[-2000:]
    # Within the host's chips the same dry run passes the check.
    code = launcher_main(["--dry-run", PROMPTS, "device=cuda", "mesh.chip=h100", "mesh.dp=4", "mesh.tp=1"])
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]


def test_ranks_that_computed_different_images_fail_the_batch(monkeypatch):
    """Under step caching each tp rank hashes the images it computed and the ranks compare: run_shard as rank 0
    of a tp group of 2, in this process, whose peer's messages are what run_shard itself sent in an earlier run
    (of the same images, or of images one level off in one pixel). A runner that hashed nothing would agree."""
    from launcher.plan.shards import Shard
    from launcher.worker import runner

    cfg = load_config("tiny", ["execution.cache=taylorseer"])
    groups = types.SimpleNamespace(tp_size=2, tp_rank=0, tp_control=None, is_writer=False)
    pixels = np.random.default_rng(0).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    sent, peer = [], []

    def gather(out, obj, group=None):  # every rank's (error, hash): this one's, then the peer's, call for call
        out[:] = [obj, peer[len(sent)] if peer else obj]
        sent.append(obj)

    def run(images: np.ndarray) -> bool:  # one batch of one image; True when the shard's ranks agreed
        def steps(pipe, batches, cfg, job, set_lora_scales=None):
            yield batches[0], lambda **kw: [{"id": "a", "pixels": images}]

        sent.clear()
        monkeypatch.setattr(runner, "shard_steps", steps)
        worker = runner.Worker(cfg, None, groups, types.SimpleNamespace(take=dict), None)
        return runner.run_shard(worker, Shard(0, ({"id": "a", "prompt": "p"},), "fp"))

    monkeypatch.setattr(runner.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(runner.dist, "all_gather_object", gather)
    assert run(pixels)  # alone with itself
    peer[:] = sent  # what a rank that computed these images says: after planning, after the batch
    other = pixels.copy()
    other[0, 0, 0] ^= 1
    assert not run(other)
    assert run(pixels.copy())  # the same images, computed again: the same hash


def test_a_stale_refusal_names_the_changed_samples_from_the_shards_data(tmp_path):
    """docs/guide.md: a run over done shards whose prompts changed exits 2 naming the changed samples, read back
    from the stale shard's Parquet data (its ids and prompts); the done shard beside it is not named."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from launcher.ledger.store import Store
    from launcher.plan.plan import make_plan

    src, out = tmp_path / "p.txt", tmp_path / "out"
    src.write_text("a red cat\na blue dog\na green tree\na grey sky\n")
    cfg = load_config("tiny", [f"dataset.path={src}", "run.shard_size=2"])
    done = {
        s.index: {"status": "done", "rows": 2, "prompts_fingerprint": s.fingerprint} for s in make_plan(cfg, {}).shards
    }
    (out / "data").mkdir(parents=True)
    for i, prompts in enumerate((["a red cat", "a blue dog"], ["a green tree", "a grey sky"])):
        rows = pa.table({"id": [str(2 * i), str(2 * i + 1)], "prompt": prompts})
        pq.write_table(rows, out / "data" / f"shard-{i:05d}.parquet")
    src.write_text("a red cat\na blue wolf\na green tree\na grey sky\n")  # row 1 (shard 0) edited
    with pytest.raises(ConfigError) as e:
        make_plan(cfg, done, store=Store(out))
    assert str(e.value) == (
        "shards [0] are done but their prompts changed since (samples 1); rerun with run.stale=regenerate to redo "
        "them, or run.stale=keep to keep the old images"
    )


def test_a_stale_refusal_names_five_changed_references_without_and_more():
    """The refusal names up to five changed references, and says " and more" only where there are more."""
    from launcher.plan.stale import stale_message

    cfg = OmegaConf.create({"dataset": {"id_column": None}})
    five = [f"r{k}.png" for k in range(5)]
    said = stale_message(cfg, {0: ([], False, five)})
    assert "their reference images changed (r0.png, r1.png, r2.png, r3.png, r4.png) since" in said, said
    said = stale_message(cfg, {0: ([], False, [*five, "r5.png"])})
    assert "their reference images changed (r0.png, r1.png, r2.png, r3.png, r4.png and more) since" in said, said


def test_an_id_shard_kept_stale_is_done_and_one_with_another_legacy_fingerprint_is_stale():
    """launcher/plan/plan_ids.py: a done shard of ids whose rows changed is stale, unless run.stale=keep recorded
    it for exactly these rows (then done); a legacy fingerprint counts only when it is the state's."""
    from launcher.plan.plan_ids import id_status
    from launcher.plan.stale import KEPT

    state = {"status": "done", "prompts_fingerprint": "old"}
    assert id_status(state, "new", None) == "stale"
    assert id_status(state, "new", "legacy") == "stale"
    assert id_status(state, "new", "old") == "done"
    assert id_status({**state, KEPT: "new"}, "new", None) == "done"


def test_a_kept_struct_columns_fingerprint_is_its_type_and_values_as_json_with_sorted_keys():
    """launcher/plan/shards.py: a kept column of another type than string or number is hashed as its type and its
    values in JSON with sorted keys; state files of earlier runs carry that fingerprint, so another encoding would
    make every done shard of such a source stale."""
    import hashlib

    import pyarrow as pa

    from launcher.plan.shards import prompts_fingerprint

    meta = pa.array([{"b": 1, "a": "x"}], pa.struct([("b", pa.int64()), ("a", pa.string())]))
    h = hashlib.sha256(b"meta\0" + b"struct<b: int64, a: string>" + b'[{"a": "x", "b": 1}]')
    assert prompts_fingerprint(pa.table({"meta": meta})) == "v2-" + h.hexdigest()[:16]


def test_planning_checks_each_rows_size_against_the_models_size_rule(tmp_path):
    """A row's height that is not a multiple of the model's size factor is refused at planning (exit 2 naming the
    file and line), by the size rule the launcher hands make_plan."""
    from launcher.plan.plan import make_plan
    from launcher.sources.prompts import SizeRule

    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "a red cat", "height": 100}) + "\n")
    cfg = load_config("tiny", [f"dataset.path={src}"])
    assert make_plan(cfg, {}).status == {0: "pending"}  # no rule: any size
    with pytest.raises(ConfigError, match=r"p\.jsonl, line 1.*height 100 is not a multiple of 16"):
        make_plan(cfg, {}, SizeRule(16, 2**20, 64, 64))


def test_run_shards_failed_holds_back_no_shard_that_failed_max_attempts_times(tmp_path):
    """run.max_attempts: run.shards=pending leaves a shard that failed that often (the summary says so);
    run.shards=failed retries it, and then the summary names no shard as not retried."""
    from launcher.plan.plan import make_plan

    src = tmp_path / "p.txt"
    src.write_text("a red cat\na blue dog\n")
    states = {0: {"status": "failed", "attempts": 3}}
    pending = make_plan(load_config("tiny", [f"dataset.path={src}", "run.shard_size=1"]), states)
    assert (pending.selected, pending.held) == ([1], [0])
    failed = make_plan(load_config("tiny", [f"dataset.path={src}", "run.shard_size=1", "run.shards=failed"]), states)
    assert (failed.selected, failed.held) == ([0], [])


def test_an_edit_job_with_a_sweep_makes_one_call_per_variant_of_each_row(tmp_path):
    """generate.sweep applies to job=edit as to text to image: each row's call is followed by one per variant, the
    variant's settings over the row's (jobs/edit.py hands make_batches its settings as a plain namespace)."""
    import hashlib

    from test_mutant_kills import job_cfg, png

    from jobs import edit

    ref = tmp_path / "r.png"
    ref.write_bytes(png("red", (8, 8)))
    sha = hashlib.sha256(ref.read_bytes()).hexdigest()
    row = {"id": "a", "prompt": "p", "ref_sha256": sha, "ref_loc": json.dumps([{"path": "r.png", "src": str(ref)}])}
    batches = edit.shard_batches([row], job_cfg(sweep={"guidance_scale": [1.0, 7.0]}))
    assert [(b.variant, b.settings["guidance_scale"]) for b in batches] == [(0, 1.0), (1, 7.0)]
    assert [b.image_ids() for b in batches] == [["a@0"], ["a@1"]]


def test_plan_refusals_of_a_zero_limit_and_a_swept_column_and_ids_only_for_text_to_image(tmp_path):
    """dataset.limit=0 selects nothing (exit 2, not an empty run); a sweep key that is also a column of the source is
    refused; shards hold ids (dataset.id_column) for a text-to-image job only, an edit job's keep row positions."""
    from launcher.plan.plan import by_id, make_plan

    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "a red cat", "guidance_scale": 3.0}) + "\n")
    with pytest.raises(ConfigError, match=r"dataset\.limit=0 selects no prompts"):
        make_plan(load_config("tiny", [f"dataset.path={src}", "dataset.limit=0"]), {})
    swept = load_config("tiny", [f"dataset.path={src}", "+generate.sweep={guidance_scale:[1.0,2.0]}"])
    with pytest.raises(ConfigError, match=r"has a column 'guidance_scale', which generate\.sweep\.guidance_scale"):
        make_plan(swept, {})
    assert by_id(load_config("tiny", ["dataset.id_column=key"]))
    assert not by_id(load_config("tiny", ["job=edit", "dataset.id_column=key"]))


@pytest.mark.parametrize(("limit", "shards"), [(4, [0, 1]), (3, [0, 1])])
def test_planning_reads_no_batch_past_dataset_limit(monkeypatch, limit, shards):
    """dataset.limit=N plans the first N rows and reads no further: at 100M prompts a limit of a few thousand must
    not read the whole source (nor fail on a bad row past the limit). Batches of 2 rows, shards of 2: rows 0-3 fill
    shards 0 and 1; the third batch is never pulled (limit 4 ends on a shard's end, limit 3 inside shard 1)."""
    import pyarrow as pa

    from launcher.plan import plan as plan_mod

    def batches(_src):
        for first in (0, 2):
            yield pa.record_batch({"prompt": [f"p{first}", f"p{first + 1}"]})
        raise AssertionError("a batch past dataset.limit was read")

    monkeypatch.setattr(plan_mod, "read_batches", batches)
    got = list(plan_mod.shard_tables(None, 2, limit))
    assert [i for i, _, _ in got] == shards
    assert [t.num_rows for _, t, _ in got] == [2, limit - 2]


def test_run_shards_all_regenerates_stale_shards_of_ids_instead_of_refusing(tmp_path, monkeypatch):
    """DESIGN, `run.shards`: `all` runs every shard; a done shard whose prompts changed is then generated again, not
    refused as stale (the refusal is for a selection that would leave it as it was). A source with ids."""
    from test_nightly import ROWS, _Nights, write

    src = tmp_path / "a.jsonl"
    write(src, ROWS[:1])
    nights = _Nights(tmp_path, monkeypatch, src, "run.shards=all")
    nights.plan()
    write(src, [{**ROWS[0], "prompt": "another"}])
    plan, _ = nights.plan()
    assert (plan.selected, plan.stale) == ([0], [0])


def test_a_night_with_images_per_prompt_reads_an_unchanged_files_ids_from_its_map(tmp_path, monkeypatch, caplog):
    """With images per prompt, each night checks every id for a clash with a sample id, an unchanged file's from
    its map (DESIGN: a rerun costs what changed): the map is read, not found damaged, and the unchanged file is not
    read again (pass 1 reads only the new file's 4 rows)."""
    from test_nightly import MORE, ROWS, _Nights, write

    d = tmp_path / "src"
    d.mkdir()
    write(d / "a.jsonl", ROWS)
    nights = _Nights(tmp_path, monkeypatch, f"{d}/*.jsonl", "generate.images_per_prompt=2")
    nights.plan()
    write(d / "b.jsonl", MORE)
    with caplog.at_level("WARNING"):
        plan, reads = nights.plan()
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
    assert [rows for _, rows in reads] == [4]
    assert sum(s.rows for s in plan.shards) == 14


def test_keep_columns_null_or_empty_keeps_no_column(tmp_path):
    """`dataset.keep_columns=null` (an override that clears a recipe's list) is no kept column, as `[]` is: the plan
    is the plain one, not a traceback."""
    from launcher.plan.plan import make_plan, source

    src = tmp_path / "p.txt"
    src.write_text("a red cat\na blue dog\n")
    for v in ("null", "[]"):
        cfg = load_config("tiny", [f"dataset.path={src}", f"dataset.keep_columns={v}"])
        assert source(cfg).keep_columns == ()
        assert [s.rows for s in make_plan(cfg, {}).shards] == [2]


def test_the_stale_refusal_holds_the_rows_of_the_first_five_stale_shards_only(tmp_path, monkeypatch):
    """The stale refusal names up to five changed samples, read from the first stale shards; planning keeps only
    those shards' rows for it, whatever the number of stale shards (at 100M prompts, all of them would be the
    whole source in memory). Seven done shards of one row, each changed since."""
    from launcher.plan import stale as stale_mod
    from launcher.plan.plan import make_plan

    src = tmp_path / "p.txt"
    src.write_text("".join(f"prompt {k}\n" for k in range(7)))
    cfg = load_config("tiny", [f"dataset.path={src}", "run.shard_size=1"])
    done = {
        s.index: {"status": "done", "rows": 1, "prompts_fingerprint": s.fingerprint} for s in make_plan(cfg, {}).shards
    }
    src.write_text("".join(f"prompt {k} changed\n" for k in range(7)))
    held = {}

    def refuse(cfg, store, stale, tables):
        held.update(stale=stale, tables=sorted(tables))
        raise ConfigError("stale")

    monkeypatch.setattr(stale_mod, "refuse", refuse)
    with pytest.raises(ConfigError):
        make_plan(cfg, done)
    assert held == {"stale": list(range(7)), "tables": [0, 1, 2, 3, 4]}


def test_rows_set_aside_and_found_again_are_named_five_at_most(tmp_path, monkeypatch):
    """A plan that finds again the rows it set aside (a bug) stops with one line naming the first five rows, as the
    other refusals name five; planning once more with them set aside is tried first, once."""
    from launcher.plan import plan as plan_mod

    late = tuple((p, f"id{p}") for p in (3, 5, 8, 13, 21, 34))
    tries = []
    monkeypatch.setattr(plan_mod, "_make_plan", lambda cfg, states, src, *_: tries.append(src.late) or _raise(late))
    src = tmp_path / "p.txt"
    src.write_text("a\n")
    with pytest.raises(ConfigError) as e:
        plan_mod.make_plan(load_config("tiny", [f"dataset.path={src}"]), {})
    assert str(e.value) == "planning set aside source rows 3, 5, 8, 13, 21 and found them again: a bug of meshgen's"
    assert tries == [(), late]


def _raise(late):
    from launcher.sources.rejected import Recheck

    raise Recheck(late)


@pytest.mark.parametrize("from_reference", [False, True])
def test_an_edit_plan_file_carries_each_rows_reference_settings_and_size(tmp_path, from_reference):
    """job=edit from a prompt file (not an earlier run's folder): pass 2 writes each row's reference by its sha256
    and place beside the row's own settings (a row's seed), and generate.size_from_reference=true gives each row
    its first reference's size rounded down to the model's factor (docs/reference.md: 100x116 -> 96x112 at 16);
    false keeps the config's size (no per-row size)."""
    import hashlib
    import io
    import json

    from PIL import Image

    from launcher.ledger.store import Store
    from launcher.plan.plan import PlanFile, make_plan, write_plan_file
    from launcher.sources.prompts import SizeRule

    refs = {}
    for name, size in (("a.png", (80, 64)), ("b.png", (100, 116))):
        buf = io.BytesIO()
        Image.effect_noise(size, 60).convert("RGB").save(buf, format="PNG")
        refs[name] = (tmp_path / name).write_bytes(buf.getvalue()) and buf.getvalue()
    rows = [{"prompt": "a", "image": "a.png", "seed": 5}, {"prompt": "b", "image": "b.png"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rule = SizeRule(16, 4 * 1024 * 1024, 64, 64, 10)
    job = [f"dataset.path={tmp_path}/p.jsonl", f"generate.size_from_reference={from_reference}", "run.shard_size=2"]
    cfg = load_config("tiny_edit", job)
    store = Store(str(tmp_path / "out"))
    write_plan_file(store, "plans/p.arrow", cfg, make_plan(cfg, {}, rule), rule)
    got = PlanFile(store, "plans/p.arrow").shard(0).rows
    assert [r["ref_sha256"] for r in got] == [hashlib.sha256(refs[n]).hexdigest() for n in ("a.png", "b.png")]
    assert [json.loads(r["ref_loc"])[0]["src"] for r in got] == [str(tmp_path / n) for n in ("a.png", "b.png")]
    assert [r.get("seed") for r in got] == [5, None]
    sizes = [(r.get("width"), r.get("height")) for r in got]
    assert sizes == ([(80, 64), (96, 112)] if from_reference else [(None, None), (None, None)])


def test_a_plan_file_under_dataset_limit_holds_the_cut_shards_rows_within_the_limit(tmp_path):
    """dataset.limit=3 with shards of 2: shard 1 is cut to its first row in the plan, and pass 2 writes that row
    only (the row past the limit is never generated)."""
    from launcher.ledger.store import Store
    from launcher.plan.plan import PlanFile, make_plan, write_plan_file

    src = tmp_path / "p.txt"
    src.write_text("zero\none\ntwo\nthree\nfour\n")
    cfg = load_config("tiny", [f"dataset.path={src}", "run.shard_size=2", "dataset.limit=3"])
    store = Store(str(tmp_path / "out"))
    plan = make_plan(cfg, {})
    write_plan_file(store, "plans/p.arrow", cfg, plan)
    assert [[r["prompt"] for r in PlanFile(store, "plans/p.arrow").shard(i).rows] for i in (0, 1)] == [
        ["zero", "one"],
        ["two"],
    ]


def test_a_plan_file_leaves_out_the_rows_set_aside_as_repeated_ids_or_of_a_bad_size(tmp_path, monkeypatch):
    """dataset.bad_rows=skip with ids: a row repeating an earlier row's id is set aside once every id was read, a
    row whose height is no multiple of the model's factor as it is read; pass 2 writes each shard's rows without
    them (the plan file holds what pass 1 planned)."""
    from test_nightly import ROWS, _Nights, write

    from launcher.plan.plan import PlanFile, write_plan_file
    from launcher.sources.prompts import SizeRule

    src = tmp_path / "a.jsonl"
    odd = {"uid": "p900", "prompt": "odd", "height": 50}
    write(src, [*ROWS[:3], {"uid": "p001", "prompt": "again"}, odd, *ROWS[3:5]])
    nights = _Nights(tmp_path, monkeypatch, src, "dataset.bad_rows=skip")
    nights.sizes = SizeRule(16, 2**20, 64, 64)
    plan, _ = nights.plan()
    assert [(r["position"], r["id"]) for r in plan.rejected] == [(3, "p001"), (4, "p900")]
    write_plan_file(nights.store, "plans/t.arrow", nights.cfg, plan, nights.sizes)
    got = [[(r["id"], r["prompt"]) for r in PlanFile(nights.store, "plans/t.arrow").shard(i).rows] for i in (0, 1)]
    assert got == [[(r["uid"], r["prompt"]) for r in ROWS[:4]], [(ROWS[4]["uid"], ROWS[4]["prompt"])]]


def test_an_edit_plan_file_leaves_out_a_row_set_aside_as_a_repeated_id(tmp_path):
    """job=edit with dataset.id_column and dataset.bad_rows=skip: the second row of an id is set aside once every
    id was read; pass 2 writes the shard without it."""
    import io
    import json

    from PIL import Image

    from launcher.ledger.store import Store
    from launcher.plan.plan import PlanFile, make_plan, write_plan_file

    buf = io.BytesIO()
    Image.effect_noise((64, 64), 60).convert("RGB").save(buf, format="PNG")
    (tmp_path / "a.png").write_bytes(buf.getvalue())
    rows = [{"uid": u, "prompt": p, "image": "a.png"} for u, p in (("x", "one"), ("y", "two"), ("x", "three"))]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = [f"dataset.path={tmp_path}/p.jsonl", "dataset.id_column=uid", "dataset.bad_rows=skip", "run.shard_size=4"]
    cfg = load_config("tiny_edit", job)
    plan = make_plan(cfg, {})
    assert [(r["position"], r["id"]) for r in plan.rejected] == [(2, "x")]
    store = Store(str(tmp_path / "out"))
    write_plan_file(store, "plans/p.arrow", cfg, plan)
    assert [(r["id"], r["prompt"]) for r in PlanFile(store, "plans/p.arrow").shard(0).rows] == [
        ("x", "one"),
        ("y", "two"),
    ]


def test_a_shard_of_ids_cut_by_dataset_limit_is_recorded_as_its_whole_fingerprint_and_the_rows_planned(
    tmp_path, monkeypatch
):
    """With ids, a shard cut by dataset.limit is fingerprinted "<its whole fingerprint>-first<rows planned>": state
    files of earlier nights carry that, so a night with the same limit finds the shard done. Limit 6 over shards
    of 4: shard 1 plans 2 of its rows."""
    from test_nightly import ROWS, _Nights, write

    src = tmp_path / "a.jsonl"
    write(src, ROWS)
    whole = _Nights(tmp_path, monkeypatch, src, out=str(tmp_path / "whole")).plan()[0]
    cut = _Nights(tmp_path, monkeypatch, src, "dataset.limit=6", out=str(tmp_path / "cut")).plan()[0]
    assert [(s.rows, s.fingerprint) for s in cut.shards] == [
        (4, whole.shards[0].fingerprint),
        (2, f"{whole.shards[1].fingerprint}-first2"),
    ]


def test_a_plan_afresh_after_a_damaged_id_map_still_finds_a_done_shard_with_missing_files(
    tmp_path, monkeypatch, caplog
):
    """DESIGN, done means verified: a damaged id map is planned afresh from the source, and that plan still checks
    the done shards' files against the folder's listing: one whose Parquet is missing is damaged and selected."""
    import json

    from test_nightly import ROWS, _Nights, write

    src = tmp_path / "a.jsonl"
    write(src, ROWS)
    nights = _Nights(tmp_path, monkeypatch, src)
    nights.plan()
    index = json.loads((tmp_path / "out" / "sources" / "index.json").read_text())
    (tmp_path / "out" / index["files"][str(src)]["map"]).write_bytes(b"PAR1 cut short")  # found as it is read
    nights.states[1]["files"] = {"data/shard-00001.parquet": [10, "0" * 64]}
    plan, _ = nights.plan()
    assert "is damaged" in caplog.text and "the source is planned afresh" in caplog.text
    assert [(s.index, s.status) for s in plan.shards] == [(0, "done"), (1, "damaged"), (2, "done")]
    assert plan.selected == [1]
