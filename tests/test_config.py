"""Config composition: every conf file composes, the contract's overrides are accepted, bad keys fail clearly."""

from pathlib import Path

import pytest

from launcher.config import available_confs, load_config
from launcher.errors import ConfigError

# Each contract key with a value the tiny conf does not have, and what the composed config must then hold, typed.
CONTRACT_OVERRIDES = {
    "device=cuda": ("device", "cuda"),
    "mesh.dp=2": ("mesh.dp", 2),
    "mesh.tp=1": ("mesh.tp", 1),
    "mesh.nodes=2": ("mesh.nodes", 2),
    "mesh.chip=v6e": ("mesh.chip", "v6e"),
    "mesh.chip_memory_gib=31.25": ("mesh.chip_memory_gib", 31.25),
    "mesh.chips_per_host=4": ("mesh.chips_per_host", 4),
    "model.path=/some/folder": ("model.path", "/some/folder"),
    "model.dtype=float16": ("model.dtype", "float16"),
    "model.shard_text_encoder=false": ("model.shard_text_encoder", False),
    "model.shard_transformer=false": ("model.shard_transformer", False),
    "dataset.path=p.jsonl": ("dataset.path", str(Path.cwd() / "p.jsonl")),  # relative: against the working dir
    "dataset.prompt_column=text": ("dataset.prompt_column", "text"),
    "dataset.id_column=key": ("dataset.id_column", "key"),
    "dataset.limit=10": ("dataset.limit", 10),
    "generate.height=128": ("generate.height", 128),
    "generate.width=96": ("generate.width", 96),
    "generate.num_inference_steps=3": ("generate.num_inference_steps", 3),
    "generate.guidance_scale=0": ("generate.guidance_scale", 0.0),
    "generate.max_sequence_length=77": ("generate.max_sequence_length", 77),
    "generate.batch_size=4": ("generate.batch_size", 4),
    "generate.seed=7": ("generate.seed", 7),
    "generate.images_per_prompt=3": ("generate.images_per_prompt", 3),
    "run.shard_size=16": ("run.shard_size", 16),
    "run.shards=failed": ("run.shards", "failed"),
    "run.shards=[0,3]": ("run.shards", [0, 3]),
    "run.overwrite=true": ("run.overwrite", True),
    "run.on_error=abort": ("run.on_error", "abort"),
    "run.stale=keep": ("run.stale", "keep"),
    "run.timeout_s=30": ("run.timeout_s", 30),
    "output.dir=/tmp/x": ("output.dir", "/tmp/x"),
    "output.format=webp": ("output.format", "webp"),
    "output.quality=80": ("output.quality", 80),
    "output.lossless=true": ("output.lossless", True),
    "output.image_files=true": ("output.image_files", True),  # off by default since issue 35
    "output.png=true": ("output.image_files", True),  # the old name still works
    "output.embed_images=false": ("output.embed_images", False),
    "dataset.keep_columns=[a,b]": ("dataset.keep_columns", ["a", "b"]),
    "dataset.keep_columns=all": ("dataset.keep_columns", "all"),
    "quality.clip_score=true": ("quality.clip_score", True),
    "quality.clip_model=org/clip": ("quality.clip_model", "org/clip"),
    "quality.safety=true": ("quality.safety", True),
    "quality.safety_model=org/checker": ("quality.safety_model", "org/checker"),
    "output.parquet=false": ("output.parquet", False),
    "output.webdataset=true": ("output.webdataset", True),
    "execution.mode=compile": ("execution.mode", "compile"),
    "execution.offload=model": ("execution.offload", "model"),
    "execution.staged=true": ("execution.staged", True),
    "execution.cache=magcache": ("execution.cache", "magcache"),
    "workers.index=1": ("workers.index", 1),
    "workers.count=2": ("workers.count", 2),
    "testing.fail_shards=[1,2]": ("testing.fail_shards", [1, 2]),
}


@pytest.mark.parametrize("conf", available_confs())
def test_every_conf_composes(conf):
    cfg = load_config(conf)
    assert cfg.name == conf
    assert cfg.mesh.dp * cfg.mesh.tp >= 1


def test_the_four_jobs_exist_with_their_settings():
    assert {"tiny", "flux2_tp", "flux1_schnell", "sd35_medium"} <= set(available_confs())
    flux2 = load_config("flux2_tp")
    assert (flux2.device, flux2.model.dtype, flux2.mesh.tp, flux2.mesh.dp) == ("tpu", "bfloat16", 8, 1)
    assert flux2.model.shard_text_encoder and flux2.model.shard_transformer
    assert (flux2.generate.height, flux2.generate.num_inference_steps) == (1024, 28)
    schnell = load_config("flux1_schnell")
    assert (schnell.execution.offload, schnell.generate.num_inference_steps, schnell.generate.guidance_scale) == (
        "model",
        4,
        0.0,
    )
    sd35 = load_config("sd35_medium")
    assert (sd35.execution.mode, sd35.mesh.tp, sd35.generate.num_inference_steps) == ("compile", 1, 40)
    tiny = load_config("tiny")
    assert (tiny.device, tiny.mesh.dp, tiny.mesh.tp, tiny.generate.height) == ("cpu", 1, 2, 64)


@pytest.mark.parametrize("override", CONTRACT_OVERRIDES)
def test_contract_overrides_are_accepted(override):
    from omegaconf import OmegaConf

    key, expected = CONTRACT_OVERRIDES[override]
    tiny = OmegaConf.select(load_config("tiny"), key)
    got = OmegaConf.select(load_config("tiny", [override]), key)
    got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
    assert tiny != expected  # else an ignored override would pass
    assert (type(got), got) == (type(expected), expected)


def test_unknown_key_names_it():
    with pytest.raises(ConfigError, match=r"heigth.*generate\.heigth"):
        load_config("tiny", ["generate.heigth=64"])


def test_unknown_conf_lists_the_available_ones():
    with pytest.raises(ConfigError, match="flux2_tp.*tiny"):
        load_config("nope")


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match="mesh.dp"):
        load_config("tiny", ["mesh.dp=two"])
