"""Parameter sweeps (`generate.sweep`) through launch.sh on the tiny FLUX.2: ids, seeds and columns read back from
Parquet, variants (the plain settings' among them) against a bare diffusers loop, dp and tp, refusals."""

from __future__ import annotations

import hashlib
import itertools
import json
import tarfile

import numpy as np
import pytest
from conftest import bare_flux2, launch, pixels, read_rows

from launcher.checks.settings import check_settings
from launcher.config import load_config
from launcher.errors import ConfigError
from launcher.plan.shards import settings, settings_fingerprint

PROMPTS = [("cat", None), ("dog", None), ("sky", 7)]  # (id, the row's own seed); 2 shards of 2 prompts
N = 2
SWEEP = "generate.sweep={guidance_scale:[2.5,4.0],num_inference_steps:[2,4]}"
# The combinations in the mapping's order, the last key fastest; v = 3 is the plain settings (tiny.yaml's).
VARIANTS = [(2.5, 2), (2.5, 4), (4.0, 2), (4.0, 4)]
PLAIN = 3


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("sweep") / "p.jsonl"
    rows = [{"key": k, "prompt": f"a photo of a {k}", **({"seed": s} if s is not None else {})} for k, s in PROMPTS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def job(run_job, prompts):
    def run(*extra: str):
        base = (f"dataset.path={prompts}", "dataset.id_column=key", "run.shard_size=2", "generate.batch_size=1")
        return run_job(*base, f"generate.images_per_prompt={N}", *extra)

    return run


def _seed(base: int, name: str) -> int:  # the contract's rule, written out again
    return int.from_bytes(hashlib.sha256(f"{base}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _base_seed(pid: str, k: int) -> int:
    row_seed = dict(PROMPTS)[pid]
    return _seed(row_seed, str(k)) if row_seed is not None else _seed(0, f"{pid}-{k}")


def test_every_prompt_at_every_variant_with_the_plain_runs_seed_and_image(job):
    out = job("mesh.tp=1", SWEEP)
    rows = read_rows(out)
    assert sorted(rows) == sorted(f"{p}-{k}@{v}" for p, _ in PROMPTS for k in range(N) for v in range(4))
    for sid, r in rows.items():
        base, v = sid.split("@")
        pid, k = base.rsplit("-", 1)
        assert (r["prompt_id"], r["variant"], r["seed"]) == (pid, int(v), _base_seed(pid, int(k))), sid
        assert (r["guidance_scale"], r["num_inference_steps"], r["height"], r["width"]) == (*VARIANTS[int(v)], 64, 64)
    import pyarrow.parquet as pq

    schema = pq.read_schema(out / "data" / "shard-00000.parquet")
    assert schema.field("variant").type == "int32" and "lora_scales" not in schema.names
    state = json.loads((out / "state" / "shard-00001.json").read_text())
    assert (state["rows"], state["prompts"]) == (N * 4, 1)
    # The variant with the plain settings is the plain run's image (the bare call's, below, as a plain run's is:
    # tests/test_speed.py); the others differ from it.
    plain = load_config("tiny").generate
    assert (plain.guidance_scale, plain.num_inference_steps) == VARIANTS[PLAIN]
    bases = sorted(f"{p}-{k}" for p, _ in PROMPTS for k in range(N))
    assert bases == sorted(s.split("@")[0] for s in rows if s.endswith(f"@{PLAIN}"))
    for base in bases:
        assert rows[f"{base}@0"]["image"]["bytes"] != rows[f"{base}@{PLAIN}"]["image"]["bytes"], base
    # A grown sweep on the done folder is another job: exit 2, one line, saying to use a new folder.
    res = launch(
        *_model_args(out), "generate.sweep={guidance_scale:[2.5,4.0,5.0],num_inference_steps:[2,4]}", "mesh.tp=1"
    )
    assert res.returncode == 2 and "choose a new output.dir" in res.stderr, res.stderr[-2000:]
    assert "generate.sweep:" in res.stderr.strip().splitlines()[-1]


def _model_args(out) -> list[str]:
    cfg = json.loads((out / "run.json").read_text())["config"]
    d = cfg["dataset"]
    return [
        f"model.path={cfg['model']['path']}",
        f"output.dir={out}",
        f"dataset.path={d['path']}",
        "dataset.id_column=key",
        "run.shard_size=2",
        "generate.batch_size=1",
        f"generate.images_per_prompt={N}",
    ]


def test_a_variant_equals_the_bare_diffusers_call(job, tiny_model):
    rows = read_rows(job("mesh.tp=1", SWEEP))
    # variant 0 (guidance 2.5, 2 steps) and the plain settings' variant, each image seeded by its base id
    for (pid, _), v in itertools.product(PROMPTS, (0, PLAIN)):
        guidance, steps = VARIANTS[v]
        seeds = [_base_seed(pid, k) for k in range(N)]
        call = dict(num_images_per_prompt=N, num_inference_steps=steps, guidance_scale=guidance)
        for k, image in enumerate(bare_flux2(tiny_model, seeds, prompt=f"a photo of a {pid}", **call)):
            assert np.array_equal(pixels(rows[f"{pid}-{k}@{v}"]["image"]["bytes"]), image), (pid, k, v)


def test_dp_staging_and_tp_change_no_image(job, tmp_path):
    import datasets

    ref = read_rows(job("mesh.tp=1", SWEEP))
    dp2 = read_rows(job("mesh.tp=1", "mesh.dp=2", "execution.staged=true", SWEEP))
    assert dp2.keys() == ref.keys()
    assert all(dp2[k]["image"]["bytes"] == ref[k]["image"]["bytes"] for k in ref)  # bitwise
    out = job("output.webdataset=true", SWEEP)  # tp=2: within 2 levels of tp=1, as for plain runs
    tp2 = read_rows(out)
    assert tp2.keys() == ref.keys()
    diff = max(int(np.abs(pixels(tp2[k]["image"]["bytes"]) - pixels(ref[k]["image"]["bytes"])).max()) for k in ref)
    assert diff <= 2
    with tarfile.open(out / "webdataset" / "shard-00001.tar") as tar:
        names = tar.getnames()
        assert names == [f"sky-{k}_{v}.{e}" for k in range(N) for v in range(4) for e in ("png", "json")]
        meta = json.loads(tar.extractfile("sky-1_2.json").read())
        swept = (meta["guidance_scale"], meta["num_inference_steps"])
        assert (meta["id"], meta["variant"], swept) == ("sky-1@2", 2, (4.0, 2))
        assert tar.extractfile("sky-1_2.png").read() == tp2["sky-1@2"]["image"]["bytes"]
    ds = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "cache"))
    assert len(ds) == len(PROMPTS) * N * 4 and ds.features["variant"] == datasets.Value("int32")
    card = (out / "README.md").read_text()
    assert "every prompt at 4 combinations" in card and "3: guidance_scale=4.0, num_inference_steps=4" in card
    from tools.contact_sheet import CELL_H, CELL_W, contact_sheet

    assert contact_sheet(out, n=8).size == (4 * CELL_W, 2 * CELL_H)  # rows of a prompt's 4 variants: 2 rows


def test_refusals_exit_2_with_a_line_and_write_nothing(tiny_model, prompts, tmp_path):
    src = tmp_path / "g.jsonl"
    src.write_text(json.dumps({"prompt": "a cat", "guidance_scale": 3.0}) + "\n")
    cases = [  # (overrides, what the line says)
        ([f"dataset.path={src}", "generate.sweep={guidance_scale:[2.5]}"], "has a column 'guidance_scale'"),
        (["generate.sweep={height:[64,100]}"], "generate.sweep.height: value 100 is not a multiple of 16"),
        (["generate.sweep={true_cfg_scale:[1.5]}"], "(flux2) has no true_cfg_scale"),
        (
            ["generate.sweep={num_inference_steps:[0]}"],
            "generate.sweep.num_inference_steps: value 0 must be in 1..1000",
        ),
    ]
    for i, (overrides, says) in enumerate(cases):
        out = tmp_path / f"out{i}"
        res = launch(f"model.path={tiny_model}", f"output.dir={out}", *overrides)
        # The last line (a prompt source is read after the mesh line, as for its other errors), and no folder.
        assert res.returncode == 2 and says in res.stderr.strip().splitlines()[-1], (overrides, res.stderr[-2000:])
        assert not out.exists()


@pytest.mark.parametrize(
    "sweep, says",
    [
        ("{guidance_scale:[2.5,nan]}", "guidance_scale: value nan is not a finite number"),
        ("{guidance_scale:[101]}", "guidance_scale: value 101 must be in 0..100"),
        ("{num_inference_steps:[2.5]}", "num_inference_steps: value 2.5 is not a whole number"),
        ("{guidance_scale:[2,2.0]}", "guidance_scale: value 2.0 is listed twice; each combination is generated once"),
        ("{guidance_scale:3}", "guidance_scale=3 must be a non-empty list of values, e.g. [2.5, 4.0]"),
        (
            "{seed:[1,2]}",
            "seed: unknown sweep key; sweep one of guidance_scale, num_inference_steps, height, width, "
            "true_cfg_scale or lora_scale.<i> (the scale of the i-th of model.loras)",
        ),
        (
            "{lora_scale.0:[0.5,1.0]}",
            "lora_scale.0: model.loras has no entry 0 (0 LoRAs configured); sweep the scale of a configured LoRA",
        ),
        ("[1,2]", "=[1, 2] must map keys to lists, e.g. {guidance_scale: [2.5, 4.0]}"),
    ],
)
def test_bad_sweeps_name_the_key_and_value(sweep, says):
    """Each refusal is one whole line: `generate.sweep.<key>` (or the sweep itself) and what is wrong with it."""
    with pytest.raises(ConfigError) as e:
        check_settings(load_config("tiny", [f"generate.sweep={sweep}"]))
    assert str(e.value) == ("generate.sweep" if says.startswith("=") else "generate.sweep.") + says


def test_the_sweep_joins_the_fingerprint_only_when_set():
    plain = settings_fingerprint(load_config("tiny"))
    assert "sweep" not in settings(load_config("tiny"))["generate"]
    assert settings_fingerprint(load_config("tiny", ["generate.sweep={}"])) == plain
    a = settings_fingerprint(load_config("tiny", ["generate.sweep={guidance_scale:[2,4]}"]))
    assert a == settings_fingerprint(load_config("tiny", ["generate.sweep={guidance_scale:[2.0,4.0]}"]))
    assert a != plain and a != settings_fingerprint(load_config("tiny", ["generate.sweep={guidance_scale:[4,2]}"]))


def test_sample_ids_of_a_sweep_may_not_repeat_a_prompt_id():
    from launcher.plan.shards import check_sample_ids, sample_ids

    assert sample_ids("a", 2, 2) == ["a-0@0", "a-0@1", "a-1@0", "a-1@1"]
    check_sample_ids(["a", "a@2", "b@x"], 1, variants=2)  # a@2 is no sample of a with V=2
    for ids, n in ((["a", "a@1"], 1), (["a@1", "a"], 1), (["a", "a-1@0"], 2)):
        with pytest.raises(ConfigError, match="is also the id of another prompt"):
            check_sample_ids(ids, n, variants=2)


def test_batches_share_their_rows_and_seeds_across_variants():
    from jobs.text_to_image import make_batches

    gen = load_config("tiny", ["generate.sweep={height:[64,128],guidance_scale:[1.0,2.0]}", "generate.batch_size=2"])
    rows = [{"id": str(i), "prompt": f"p{i}"} for i in range(3)]
    batches = make_batches(rows, gen.generate)
    assert [(b.chunk, b.variant, b.shape[:2], b.shape[3]) for b in batches[:4]] == [
        (0, 0, (64, 64), 1.0), (0, 1, (64, 64), 2.0), (0, 2, (128, 64), 1.0), (0, 3, (128, 64), 2.0),
    ]  # fmt: skip
    assert len(batches) == 8 and len({(b.chunk, tuple(b.seeds)) for b in batches}) == 2
    samples = batches[5].samples(np.zeros((2, 64, 64, 3)))
    assert [s["id"] for s in samples] == ["2@1"] and samples[0]["guidance_scale"] == 2.0


def test_lora_scale_and_true_cfg_sweeps_plan_their_batches_and_columns():
    import datasets
    import pyarrow as pa
    from omegaconf import OmegaConf

    from jobs.text_to_image import make_batches
    from launcher.checks.sweep_checks import check_sweep_model
    from launcher.writer.writer import schema_of

    gen = load_config("tiny", ["generate.sweep={true_cfg_scale:[1.0,2.0],lora_scale.1:[0.5,1.0]}"]).generate
    batches = make_batches([{"id": "a", "prompt": "p"}], gen, lora_scales=(1.0, 0.8))
    assert [(b.settings["true_cfg_scale"], b.lora_scales) for b in batches] == [
        (1.0, (1.0, 0.5)), (1.0, (1.0, 1.0)), (2.0, (1.0, 0.5)), (2.0, (1.0, 1.0)),
    ]  # fmt: skip
    assert len({b.chunk for b in batches}) == 1  # one encoding for all four (per LoRA scales, once fusing follows)
    samples = [s | {"image": None} for b in batches for s in b.samples(np.zeros((2, 64, 64, 3)))]
    assert [(s["id"], s["lora_scales"], s["true_cfg_scale"]) for s in samples][1] == ("a@1", [1.0, 1.0], 1.0)
    schema = schema_of(samples)
    table = pa.Table.from_pylist([{k: s.get(k) for k in schema.names} for s in samples], schema=schema)
    features = datasets.Features.from_dict(json.loads(schema.metadata[b"huggingface"])["info"]["features"])
    assert list(features) == table.column_names and features["lora_scales"] == datasets.List(datasets.Value("float32"))
    assert table.column("variant").to_pylist() == [0, 1, 2, 3]
    # Swept LoRA scales are refused at preflight until re-fusing follows them (the LoRA engineer's hook).
    cfg = OmegaConf.create({"generate": {"sweep": {"lora_scale.0": [0.5, 1.0]}}, "model": {"loras": [{"path": "x"}]}})
    with pytest.raises(ConfigError, match=r"generate.sweep.lora_scale.0: sweeping a LoRA's scale is not supported"):
        check_sweep_model(cfg, None)  # refused before the model is asked anything
