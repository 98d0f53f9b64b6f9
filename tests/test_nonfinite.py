"""A sample whose decoded output holds NaN fails its shard, naming the sample and the model that made the values.

Once cast to uint8 a NaN is a black pixel: without a check, a VAE that overflows (float16) writes a shard of black
images and marks it done. Real launches of the tiny FLUX.2 whose VAE decoder has one NaN weight.
"""

import json
import shutil
from pathlib import Path

import pytest
from conftest import launch


@pytest.fixture(scope="module")
def nan_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with one bias of the VAE decoder's last convolution set to NaN: every decoded image is NaN
    in one channel, whatever the latents."""
    from safetensors.torch import load_file, save_file

    model = tmp_path_factory.mktemp("nan") / "tiny-flux2-nan"
    shutil.copytree(tiny_model, model)
    [weights] = (model / "vae").glob("*.safetensors")
    tensors = load_file(weights)
    tensors["decoder.conv_out.bias"][0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    return model


def states(out: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted((out / "state").glob("shard-*.json"))}


@pytest.mark.parametrize("staged", ["false", "true"])
def test_a_vae_that_gives_nan_fails_the_shard_naming_the_sample_and_the_vae(nan_model, tmp_path, staged):
    (tmp_path / "p.txt").write_text("a red fox\na blue bird\na green frog\n")
    out = tmp_path / "out"
    res = launch(
        f"model.path={nan_model}",
        f"dataset.path={tmp_path / 'p.txt'}",
        f"output.dir={out}",
        "mesh.tp=1",
        "generate.num_inference_steps=2",
        "run.shard_size=2",
        f"execution.staged={staged}",
    )
    assert res.returncode == 3, res.stderr[-3000:]  # the contract's "a shard failed"
    got = states(out)
    assert sorted(got) == ["shard-00000.json", "shard-00001.json"], got
    ids = {"shard-00000.json": ("'0'", "'1'"), "shard-00001.json": ("'2'",)}
    for name, state in got.items():
        assert state["status"] == "failed", state
        assert "vae" in state["error"] and "non-finite" in state["error"], state["error"]
        for sid in ids[name]:
            assert sid in state["error"], (sid, state["error"])
    assert not list(out.rglob("*.parquet")), list(out.rglob("*.parquet"))  # no image of NaN is kept


def test_staged_latents_that_are_not_finite_name_the_transformer_and_the_sample():
    """Staged, the latents are checked on the chip before the VAE decodes them; a padded row is not a sample."""
    import torch

    from jobs.text_to_image import Batch, NonFiniteOutput, check_finite

    rows = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "b", "prompt": "y"}]  # 1 padded
    batch = Batch(rows=rows, n_real=2, shape=(64, 64, 2, 4.0), seeds=[0] * 6, images_per_prompt=2)
    latents = torch.zeros(6, 16, 8)
    latents[5, 0, 0] = float("nan")  # the padded row's: dropped, never checked
    check_finite(batch, latents, "transformer")
    latents[1, 3, 2] = float("inf")
    with pytest.raises(NonFiniteOutput, match=r"the transformer gave non-finite values .* sample 'a-1' \(1 of 4"):
        check_finite(batch, latents, "transformer")
