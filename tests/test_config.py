"""Config composition: every conf file composes, the contract's overrides are accepted, bad keys fail clearly."""

import pytest

from launcher.config import available_confs, load_config
from launcher.errors import ConfigError

CONTRACT_OVERRIDES = [
    "device=cpu",
    "mesh.dp=2",
    "mesh.tp=1",
    "mesh.nodes=1",
    "model.path=/some/folder",
    "model.dtype=float16",
    "model.shard_text_encoder=false",
    "model.shard_transformer=false",
    "dataset.path=p.jsonl",
    "dataset.prompt_column=text",
    "dataset.id_column=key",
    "dataset.limit=10",
    "generate.height=128",
    "generate.width=96",
    "generate.num_inference_steps=3",
    "generate.guidance_scale=0",
    "generate.max_sequence_length=77",
    "generate.batch_size=4",
    "generate.seed=7",
    "run.shard_size=16",
    "run.shards=failed",
    "run.shards=[0,3]",
    "run.overwrite=true",
    "run.on_error=abort",
    "output.dir=/tmp/x",
    "output.png=false",
    "output.parquet=true",
    "execution.mode=compile",
    "execution.offload=model",
    "workers.index=1",
    "workers.count=2",
    "testing.fail_shards=[1,2]",
]


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
    cfg = load_config("tiny", [override])
    key, value = override.split("=", 1)
    group, _, leaf = key.partition(".")
    got = cfg[group][leaf] if leaf else cfg[group]
    assert str(got).lower().replace(" ", "") == value.lower() or str(got) in value or value in str(got)


def test_unknown_key_names_it():
    with pytest.raises(ConfigError, match=r"heigth.*generate\.heigth"):
        load_config("tiny", ["generate.heigth=64"])


def test_unknown_conf_lists_the_available_ones():
    with pytest.raises(ConfigError, match="flux2_tp.*tiny"):
        load_config("nope")


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match="mesh.dp"):
        load_config("tiny", ["mesh.dp=two"])
