"""Known answers for the contract (DESIGN.md): sample seeds, sample ids and what the fingerprint covers.

Every expected number here was computed once, outside the product, from the contract's words (hashlib on
"<seed>:<id>", the first 8 bytes little-endian, masked to 63 bits; json.dumps of the fingerprinted settings) and
pasted in as a literal: a test that recomputes its answer with the product's rule cannot catch a change of rule.
"""

import pytest
import torch
from omegaconf import OmegaConf

from jobs.text_to_image import make_batches
from launcher.config import load_config
from launcher.plan.shards import (
    image_seeds,
    row_seed,
    sample_ids,
    sample_seed,
    settings,
    settings_diff,
    settings_fingerprint,
)

# sha256("<job seed>:<sample id>") -> first 8 bytes little-endian & (2**63 - 1), by hand (hashlib), once.
KNOWN_SEEDS = {
    (0, "0"): 4690615940414861996,
    (0, "1"): 6746404440217949167,
    (0, "a"): 7462446685336499101,
    (0, "a-0"): 3749917565733378860,
    (0, "a-1"): 1884505624281420165,
    (0, "a-2"): 7065398258961705235,
    (42, "0"): 8283191608820986708,
    (42, "a-1"): 283748342123092478,
    (11, "0"): 5455560158644910768,
    (11, "1"): 9217403327602951504,
    (123456789, "prompt-7"): 6490472573646234063,
}


@pytest.mark.parametrize(("base", "sample_id"), sorted(KNOWN_SEEDS))
def test_sample_seed_is_the_contracts_sha256(base, sample_id):
    assert sample_seed(base, sample_id) == KNOWN_SEEDS[base, sample_id]


def test_a_rows_own_seed_wins_even_when_it_is_zero():
    assert row_seed({"id": "a", "seed": 0}, 42) == 0  # 0 is a seed, not "no seed"
    assert row_seed({"id": "a", "seed": 11}, 42) == 11
    assert row_seed({"id": "a"}, 0) == 7462446685336499101
    assert row_seed({"id": "a", "seed": None}, 0) == 7462446685336499101  # an empty cell is no seed
    assert image_seeds({"id": "a", "seed": 0}, 42, 1) == [0]


def test_a_row_seed_with_n_images_seeds_each_from_row_seed_and_k():
    # sha256("<row seed>:<k>"), not the job seed and the sample id
    assert image_seeds({"id": "a", "seed": 11}, 0, 2) == [5455560158644910768, 9217403327602951504]
    assert image_seeds({"id": "a", "seed": 0}, 42, 2) == [4690615940414861996, 6746404440217949167]
    # without a row seed: the job seed and the sample ids a-0, a-1, ...
    assert image_seeds({"id": "a"}, 0, 3) == [3749917565733378860, 1884505624281420165, 7065398258961705235]
    assert image_seeds({"id": "a", "seed": None}, 42, 2)[1] == 283748342123092478


def test_sample_ids():
    assert sample_ids("a", 1) == ["a"]
    assert sample_ids("a", 3) == ["a-0", "a-1", "a-2"]
    assert sample_ids("x-1", 2) == ["x-1-0", "x-1-1"]


def test_batches_carry_the_contracts_ids_and_seeds():
    """The seeds a batch hands the pipeline and the ids its samples get, for rows with and without a seed."""
    gen = OmegaConf.create(
        {"height": 64, "width": 64, "num_inference_steps": 4, "guidance_scale": 1.0, "batch_size": 2, "seed": 0}
    )
    gen.images_per_prompt = 2
    rows = [{"id": "a", "prompt": "p"}, {"id": "b", "prompt": "q", "seed": 0}]
    [batch] = make_batches(rows, gen)
    assert batch.seeds == [3749917565733378860, 1884505624281420165, 4690615940414861996, 6746404440217949167]
    gen.images_per_prompt = 1
    [batch] = make_batches(rows, gen)
    assert batch.seeds == [7462446685336499101, 0]


def test_sweep_variants_use_their_base_ids_seed():
    """`<base id>@<v>` is seeded as its base id: a@3 of job seed 0 gets the seed of "a" (7462446685336499101),
    not sha256("0:a@3") (8273243467507124308); with N = 2 the bases are a-0 and a-1. (The edit job's seeds are
    checked against the contract's words, image for image, in tests/test_edit.py.)"""
    gen = OmegaConf.create(
        {"height": 64, "width": 64, "num_inference_steps": 4, "guidance_scale": 1.0, "batch_size": 1, "seed": 0}
    )
    gen.images_per_prompt = 1
    gen.sweep = {"guidance_scale": [1.0, 2.0, 3.0, 4.0]}
    batches = make_batches([{"id": "a", "prompt": "p"}], gen)
    assert [b.variant for b in batches] == [0, 1, 2, 3]
    assert [b.seeds for b in batches] == [[7462446685336499101]] * 4
    assert sample_ids("a", 1, 4) == ["a@0", "a@1", "a@2", "a@3"]
    gen.images_per_prompt = 2
    batches = make_batches([{"id": "a", "prompt": "p"}], gen)
    assert [b.seeds for b in batches] == [[3749917565733378860, 1884505624281420165]] * 4
    assert sample_ids("a", 2, 2) == ["a-0@0", "a-0@1", "a-1@0", "a-1@1"]


# The tiny conf's fingerprinted settings with model.path=org/model, written out by hand from the contract and
# hashed with hashlib: sha256(json.dumps(settings, sort_keys=True))[:16]. Old run folders carry this value, so a
# change here breaks every resume of them.
TINY_SETTINGS = {
    "model": {"path": "org/model", "dtype": "float32", "call_kwargs": {"text_encoder_out_layers": [1, 2]}},
    "generate": {
        "height": 64,
        "width": 64,
        "num_inference_steps": 4,
        "guidance_scale": 4.0,
        "max_sequence_length": 256,
        "seed": 0,
    },
    "run": {"shard_size": 8},
}
TINY_FINGERPRINT = "200d9efc8c873ad0"

# Every key the contract fingerprints ("what determines the images"), each with a value the tiny conf does not
# have (or the whole override, for a mapping). model.loras and generate.sweep join when they exist (issue 22):
# see COMING.
COVERED = {
    "model.path": "org/other",
    "model.dtype": "bfloat16",
    "model.call_kwargs": "model.call_kwargs.text_encoder_out_layers=[1]",
    "generate.height": "128",
    "generate.width": "128",
    "generate.num_inference_steps": "5",
    "generate.guidance_scale": "0",
    "generate.max_sequence_length": "128",
    "generate.seed": "1",
    "generate.images_per_prompt": "2",
    "run.shard_size": "4",
    "execution.cache": "taylorseer",
    "execution.cache_options": "+execution.cache_options.cache_interval=3",
    "output.format": "jpeg",
    "output.quality": "90",
    "output.lossless": "true",
    # an edit job also fingerprints generate.reference_fit off "stretch" (what edit runs did before the key): at
    # stretch, the job alone differs
    "job": "job=edit generate.reference_fit=stretch",
    "generate.size_from_reference": "true",
    "output.reference_bytes": "true",
    "generate.sweep": "generate.sweep={guidance_scale:[1.0,2.0]}",
}
# Every key it leaves out ("how the work is run"), each with a value the tiny conf does not have.
LEFT_OUT = {
    "device": "cuda",
    "model.shard_text_encoder": "false",
    "model.shard_transformer": "false",
    "model.build": "null",
    "model.license": "mit",
    "mesh.dp": "2",
    "mesh.tp": "1",
    "mesh.nodes": "2",
    "mesh.chip": "v6e",
    "mesh.chip_memory_gib": "16",
    "mesh.chips_per_host": "8",
    "dataset.path": "/elsewhere/p.txt",
    "dataset.prompt_column": "text",
    "dataset.id_column": "key",
    "dataset.limit": "3",
    "generate.batch_size": "5",
    "run.shards": "failed",
    "run.overwrite": "true",
    "run.on_error": "abort",
    "run.stale": "keep",
    "run.timeout_s": "60",
    "run.max_attempts": "5",
    "dataset.bad_rows": "skip",  # a set-aside row is left out of its shard's prompts fingerprint, not the settings
    "output.publish": "hf://datasets/org/name",
    "output.metrics": "/tmp/meshgen.prom",
    # fingerprinted for job=edit only, off its default (tests/test_runtime_bounds.py); tiny is text to image
    "generate.reference_fit": "pad",
    "output.dir": "/elsewhere/out",
    "output.image_files": "true",  # how images are stored, not what they are (default false since issue 35)
    "output.png": "true",
    "output.embed_images": "false",
    # kept values are in each shard's prompts fingerprint (tests/test_outputs.py), not in the settings'
    "dataset.keep_columns": "[category]",
    # quality columns change no image: only columns (tests/test_quality.py)
    "quality.clip_score": "true",
    "quality.clip_model": "org/clip",
    "quality.safety": "true",
    "quality.safety_model": "org/checker",
    "quality.batch_size": "4",
    "output.parquet": "false",
    "output.webdataset": "true",
    "output.row_group_size": "8",
    "output.png_encoder": "pil",
    "output.png_level": "9",
    "output.webp_method": "4",
    "output.encode_workers": "3",
    "output.queue_shards": "5",
    "execution.mode": "compile",
    "execution.offload": "model",
    "execution.compile_cache_dir": "/tmp/cc",
    "execution.staged": "true",
    "execution.release_text_encoder": "false",
    "workers.index": "1",
    "workers.count": "2",
    "testing.fail_shards": "[1]",
    "testing.compile_backend": "aot_eager",
    "testing.hold_after_ledger_read": "/tmp/never",
    "testing.batch_sleep_s": "0.5",
    "testing.hold_batches_until": "/tmp/never",
    "dataset.image_column": "picture",  # the references' content hashes are in each shard's prompt fingerprint
}
# model.loras is fingerprinted by its files' content: test_loras_are_fingerprinted_by_content_and_scale.
COMING = {"model.loras"}


def _cfg(*overrides: str):
    return load_config("tiny", ["model.path=org/model", *overrides])


def test_the_tiny_fingerprint_is_a_known_answer():
    cfg = _cfg()
    assert settings(cfg) == TINY_SETTINGS
    assert settings_fingerprint(cfg) == TINY_FINGERPRINT


def test_every_key_the_contract_covers_changes_the_fingerprint_and_is_named():
    for key, value in COVERED.items():
        cfg = _cfg(*(value.split(" ") if "=" in value else [f"{key}={value}"]))
        assert settings_fingerprint(cfg) != TINY_FINGERPRINT, key
        assert [d.split(":")[0] for d in settings_diff(TINY_SETTINGS, settings(cfg))] == [key], key


def test_no_key_the_contract_leaves_out_changes_the_fingerprint():
    """All of them changed at once leave the fingerprint as it is; only where they do not is each key composed on
    its own, to name those that change it (one composition where 90 took 8 s, a cost each mutant of the
    fingerprint's code paid under `make mutants`)."""
    if settings_fingerprint(_cfg(*(f"{k}={v}" for k, v in LEFT_OUT.items()))) != TINY_FINGERPRINT:
        base = settings_fingerprint(_cfg())  # the contract's TINY_FINGERPRINT, unless the known-answer test fails too
        changing = [k for k, v in LEFT_OUT.items() if settings_fingerprint(_cfg(f"{k}={v}")) != base]
        raise AssertionError(f"keys the contract leaves out change the fingerprint: {changing or 'only together'}")


def test_every_config_key_is_classified_as_fingerprinted_or_not():
    """A new key must be put in COVERED or LEFT_OUT: unclassified, it could silently mix images on a resume."""

    def leaves(node, prefix=""):
        for k, v in node.items():
            if OmegaConf.is_dict(v) and f"{prefix}{k}" not in ("model.call_kwargs", "execution.cache_options"):
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    cfg = load_config("tiny")
    keys = set(leaves(OmegaConf.masked_copy(cfg, list(cfg.keys())))) - {"name"}
    assert keys - set(COVERED) - set(LEFT_OUT) - COMING == set()


# What each change of a covered key reads as, when a resume is refused: old -> new, a left-out key as its default.
DIFF_LINES = {
    "generate.guidance_scale": "generate.guidance_scale: 4.0 -> 0.0",
    "generate.images_per_prompt": "generate.images_per_prompt: 1 -> 2",
    "execution.cache": "execution.cache: 'none' -> 'taylorseer'",
    "output.lossless": "output.lossless: False -> True",
    "model.call_kwargs": "model.call_kwargs: {'text_encoder_out_layers': [1, 2]} -> {'text_encoder_out_layers': [1]}",
}


def test_a_refused_resume_names_old_and_new_values():
    for key, line in DIFF_LINES.items():
        value = COVERED[key]
        new = settings(_cfg(value if "=" in value else f"{key}={value}"))
        assert settings_diff(TINY_SETTINGS, new) == [line]


def _prompts_table():
    import pyarrow as pa

    return pa.table(
        {
            "id": pa.array(["a", "b", "c"]),
            "prompt": pa.array(["x", None, "zz"]),
            "seed": pa.array([None, 7, 0], pa.int64()),
            "guidance_scale": pa.array([1.5, None, None], pa.float64()),
            "negative_prompt": pa.array([None, None, None], pa.string()),
        }
    )


def test_prompt_fingerprints_are_known_answers():
    """State files carry these: a change of the hashing makes every done shard of every old folder stale.
    The legacy value is by hand (hashlib over json.dumps of each row without its empty cells, sorted keys, one
    line each); the v2 values were recorded once, for the same reason as the tiny fingerprint above."""
    from launcher.plan.shards import legacy_fingerprint, prompts_fingerprint, same_prompts

    t = _prompts_table()
    assert legacy_fingerprint(t) == "a3b1d4c10c9b5fd5"
    assert prompts_fingerprint(t) == "v2-3fe8827bc99e369c"
    assert prompts_fingerprint(t.slice(1)) == "v2-9f51244d47da5da1"  # a zero-copy slice, offsets not at 0
    fresh = _prompts_table().slice(1).to_pylist()
    import pyarrow as pa

    assert prompts_fingerprint(pa.Table.from_pylist(fresh, schema=t.schema)) == "v2-9f51244d47da5da1"
    assert prompts_fingerprint(t.drop_columns(["negative_prompt"])) == "v2-3fe8827bc99e369c"  # all empty: left out
    assert same_prompts("v2-3fe8827bc99e369c", t) and same_prompts("a3b1d4c10c9b5fd5", t)
    assert same_prompts(None, t)  # a state without a fingerprint (the oldest runs): trusted
    assert not same_prompts("v2-9f51244d47da5da1", t) and not same_prompts("a3b1d4c10c9b5fd4", t)
    assert same_prompts("v2-3fe8827bc99e369c", t, known="v2-3fe8827bc99e369c")
    assert not same_prompts("v2-3fe8827bc99e369c", t, known="v2-0000000000000000")


def test_run_shards_selection():
    from launcher.errors import ConfigError
    from launcher.plan.shards import parse_selection

    assert [parse_selection(s, 4) for s in ("pending", "failed", "all")] == ["pending", "failed", "all"]
    assert parse_selection([3, 0, 3], 4) == [0, 3] and parse_selection(2, 4) == [2] and parse_selection("1", 4) == [1]
    assert parse_selection([0, 3], 4) == [0, 3]
    with pytest.raises(ConfigError, match=r"^run.shards='some' is not pending, failed, all or a list like \[0,3\]$"):
        parse_selection("some", 4)
    message = r"^run.shards names shards \[4, -1\] that do not exist: the dataset has 4 shards \(0..3\)$"
    with pytest.raises(ConfigError, match=message):
        parse_selection([4, -1, 3], 4)


def test_prompt_fingerprints_see_values_not_layout():
    """Chunks, slices in the middle and integer widths are layout: the same rows hash the same."""
    import pyarrow as pa

    from launcher.plan.shards import legacy_fingerprint, prompts_fingerprint

    t = _prompts_table()
    two_chunks = pa.concat_tables([t.slice(0, 1), t.slice(1)])
    assert two_chunks.column("id").num_chunks == 2 and prompts_fingerprint(two_chunks) == "v2-3fe8827bc99e369c"
    middle = t.slice(0, 2)
    assert prompts_fingerprint(middle) == prompts_fingerprint(pa.Table.from_pylist(middle.to_pylist(), t.schema))
    assert prompts_fingerprint(middle) != prompts_fingerprint(t)
    narrow = t.set_column(2, "seed", t.column("seed").cast(pa.int32()))
    assert prompts_fingerprint(narrow) == "v2-3fe8827bc99e369c"
    # by hand: sha256 of '{"id": "0", "prompt": "café ☕"}' + newline, as UTF-8 (not \\u escapes)
    assert legacy_fingerprint(pa.table({"id": ["0"], "prompt": ["café ☕"]})) == "e85adb7daa74a24b"


def test_colliding_sample_ids_are_named_in_one_line():
    from launcher.errors import ConfigError
    from launcher.plan.shards import check_sample_ids

    with pytest.raises(ConfigError) as e:
        check_sample_ids(["x-1", "x-1-0"], 2)
    assert str(e.value) == (
        "the dataset: with generate.images_per_prompt=2, prompt 'x-1' has a sample id 'x-1-0', which is also the id "
        "of another prompt; rename one of them (or use dataset.id_column)"
    )
    check_sample_ids(["x-1", "x-2"], 2)  # x-1's samples are x-1-0 and x-1-1: no clash with x-2


def test_loras_are_fingerprinted_by_content_and_scale(tmp_path):
    """Each LoRA's content hash and scale join the fingerprint; where its file lies does not."""
    from safetensors.torch import save_file

    def lora(name: str, value: float) -> str:
        path = tmp_path / name
        save_file({"transformer.x.lora_A.weight": torch.full((2, 2), value)}, str(path))
        return str(path)

    a, same, other = lora("a.safetensors", 1.0), lora("copy.safetensors", 1.0), lora("b.safetensors", 2.0)
    fp = {
        name: settings_fingerprint(_cfg(f"model.loras=[{{path:{path},scale:{scale}}}]"))
        for name, path, scale in (("a", a, 1.0), ("copy", same, 1.0), ("other", other, 1.0), ("half", a, 0.5))
    }
    assert TINY_FINGERPRINT not in fp.values()
    assert fp["a"] == fp["copy"]  # the same bytes elsewhere
    assert len({fp["a"], fp["other"], fp["half"]}) == 3
    assert [d.split(":")[0] for d in settings_diff(TINY_SETTINGS, settings(_cfg(f"model.loras=[{{path:{a}}}]")))] == [
        "model.loras"
    ]
