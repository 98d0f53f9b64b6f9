"""Pure functions: mesh validation, shard assignment, seeds, batching, fingerprints."""

import hashlib

import pytest
from conftest import contract_seed
from omegaconf import OmegaConf

from jobs.text_to_image import make_batches
from launcher.config import load_config
from launcher.errors import ConfigError
from launcher.plan.shards import (
    parse_selection,
    preference,
    row_seed,
    sample_seed,
    settings_fingerprint,
)
from launcher.worker.dist import ParallelDims
from launcher.workers import resolve_workers


def test_parallel_dims_checks_the_world_size_with_numbers():
    ParallelDims(2, 4, 8)
    with pytest.raises(ConfigError, match=r"2 \* 2 = 4 but the world size is 8"):
        ParallelDims(2, 2, 8)
    with pytest.raises(ConfigError, match="at least 1"):
        ParallelDims(0, 2, 0)


@pytest.mark.parametrize("slots", range(1, 13))  # workers x dp replicas
def test_slots_split_any_selection_exactly_once(slots):
    selected = [0, 2, 3, 5, 6, 7, 8, 11, 12, 13]
    shares = [preference(selected, slot, slots)[: len(selected[slot::slots])] for slot in range(slots)]
    assert sorted(i for share in shares for i in share) == selected
    for slot in range(slots):
        assert sorted(preference(selected, slot, slots)) == selected  # and each may take over any other


def test_a_few_shards_are_spread_over_slots():
    assert [preference([3, 9, 14], s, 3)[0] for s in range(3)] == [3, 9, 14]


def test_seeds_are_the_contracts_hash_of_seed_and_id():
    """DESIGN.md's words, worked out with hashlib here (contract_seed) and, for two, written out."""
    assert sample_seed(0, "a") == contract_seed(0, "a") == 7462446685336499101
    assert sample_seed(5, "a") == contract_seed(5, "a") != sample_seed(0, "a")
    assert sample_seed(0, "a-1") == contract_seed(0, "a-1") == 1884505624281420165
    assert [sample_seed(123, str(i)) for i in range(100)] == [contract_seed(123, str(i)) for i in range(100)]
    # The top bit is masked off: a seed whose digest's 8th byte has it set still fits an int64.
    high = next(i for i in range(100) if hashlib.sha256(f"0:{i}".encode()).digest()[7] & 0x80)
    assert sample_seed(0, str(high)) == contract_seed(0, str(high)) < 2**63
    assert row_seed({"id": "a", "seed": 42}, 0) == 42  # the row's own seed, as it is
    assert row_seed({"id": "a", "seed": None}, 5) == row_seed({"id": "a"}, 5) == contract_seed(5, "a")


def test_shards_are_cut_on_stable_row_boundaries(tmp_path):
    from launcher.plan.plan import shard_tables
    from launcher.plan.shards import prompts_fingerprint
    from launcher.sources.prompts import Source

    (tmp_path / "a.txt").write_text("".join(f"p{i}\n" for i in range(7)))
    (tmp_path / "b.txt").write_text("".join(f"p{i}\n" for i in range(10)))
    a, b = (
        [(t.num_rows, prompts_fingerprint(t)) for _, t, _ in shard_tables(Source(str(tmp_path / f)), 4, None)]
        for f in ("a.txt", "b.txt")
    )
    assert [n for n, _ in b] == [4, 4, 2]
    assert a[0][1] == b[0][1] and a[1][1] != b[1][1]


def test_batches_are_padded_and_bucketed_by_shape():
    gen = OmegaConf.create(
        {"height": 64, "width": 64, "num_inference_steps": 4, "guidance_scale": 1.0, "batch_size": 3, "seed": 5}
    )
    gen.images_per_prompt = 1
    rows = [{"id": str(i), "prompt": "p"} for i in range(5)] + [{"id": "w", "prompt": "p", "width": 128}]
    batches = make_batches(rows, gen)
    assert [(len(b.rows), b.n_real, b.shape[:2]) for b in batches] == [
        (3, 3, (64, 64)),
        (3, 2, (64, 64)),
        (3, 1, (64, 128)),
    ]
    assert batches[1].rows[2] is batches[1].rows[1]
    assert batches[0].seeds == [contract_seed(5, str(i)) for i in range(3)]
    assert batches[1].seeds == [contract_seed(5, "3"), contract_seed(5, "4"), contract_seed(5, "4")]  # padded
    assert batches[2].seeds == [contract_seed(5, "w")] * 3 and batches[2].settings["width"] == 128


def test_fingerprint_ignores_how_the_work_is_run():
    base = settings_fingerprint(load_config("tiny"))
    for o in [
        "mesh.dp=2",
        "generate.batch_size=5",
        "execution.mode=compile",
        "dataset.limit=3",
        "workers.count=2",
        "testing.fail_shards=[1]",
        "output.png=false",
    ]:
        assert settings_fingerprint(load_config("tiny", [o])) == base, o
    for o in ["generate.seed=1", "generate.height=128", "model.dtype=bfloat16", "run.shard_size=4"]:
        assert settings_fingerprint(load_config("tiny", [o])) != base, o


def test_selection_names_missing_shards():
    assert parse_selection([3, 0], 4) == [0, 3]
    with pytest.raises(ConfigError, match=r"\[7\].*4 shards"):
        parse_selection([7], 4)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (0, 1)),
        ({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "5"}, (2, 5)),
        ({"JOB_COMPLETION_INDEX": "1", "MESHGEN_WORKERS": "3"}, (1, 3)),
        ({"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "a,b,c,d"}, (1, 4)),
    ],
)
def test_workers_from_the_schedulers_env(env, expected):
    assert resolve_workers(load_config("tiny"), env) == expected


@pytest.mark.parametrize(
    ("size", "w", "h", "cover", "box"),
    [((20, 10), 13, 8, (16, 8), (1, 0, 14, 8)), ((10, 20), 8, 13, (8, 16), (0, 1, 8, 14))],
)
def test_a_crop_with_an_odd_overhang_is_the_bucket_size_cut_one_pixel_left_or_above_the_middle(size, w, h, cover, box):
    """generate.reference_fit=crop: resized to cover w x h (20x10 by 0.8 to 16x8 for 13x8: 3 columns over), then
    the middle cut out. An odd overhang leaves a pixel more on one side: its first (or top) column goes with the
    floor of half, as the pad's centering does, and the reference is exactly the bucket's size (a half-pixel box
    is rounded by PIL to 12 columns: a call of the bucket would get another shape)."""
    import numpy as np
    from PIL import Image

    from jobs.edit import fit_image

    im = Image.fromarray(np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    want = im.resize(cover, Image.Resampling.LANCZOS).crop(box)
    got = fit_image(im, w, h, "crop")
    assert got.size == (w, h) and np.array_equal(np.asarray(got), np.asarray(want))


def test_a_reference_is_read_through_its_icc_profile_only_in_the_modes_the_guide_names(caplog):
    """docs/guide.md: RGB, RGBA and CMYK go through their embedded ICC profile; without a profile, PIL's conversion
    and no warning (the warning is for a profile that cannot be used). A palette image is not read through its
    profile: lcms would take its palette indices for grey levels (a grey profile's transform accepts them)."""
    from PIL import Image
    from test_mutant_kills import icc

    from jobs.edit import to_rgb

    plain = Image.new("RGB", (2, 2), (10, 20, 30))
    with caplog.at_level("WARNING"):
        assert to_rgb(plain).getpixel((1, 1)) == (10, 20, 30)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    palette = Image.new("P", (2, 2), 0)
    palette.putpalette([200, 0, 0] + [0, 0, 0] * 255)  # index 0 is red
    palette.info["icc_profile"] = icc(b"mntr", b"GRAY", b"XYZ ", {b"kTRC": b"curv" + bytes(8)})  # linear grey
    assert to_rgb(palette).getpixel((1, 1)) == (200, 0, 0)
