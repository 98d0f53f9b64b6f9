"""Every value reaches the pipeline through a bounded, recorded path (issue 32, items 3-5), refused at the preflight:
`model.call_kwargs` may not set what has its own setting, and its numbers are finite; a LoRA's tensors are finite
and each of its keys names a layer; a row column the family's pipeline ignores is refused. Each refusal runs the
launcher's main() in this process as a dry run and (where it is cheap) a real run: exit 2, one last line.
"""

from __future__ import annotations

import inspect
import json

import pytest

from tools.make_tiny_lora import FLUX2, make_lora


def refused(launcher_main, capsys, args: list[str], *expected: str) -> str:
    code = launcher_main(args)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1] if err.strip() else ""
    assert code == 2, err[-3000:]
    assert "Traceback" not in err and last.startswith("error: "), last
    for e in expected:
        assert e in last, last
    return last


# (overrides, what the last line must name)
CALL_KWARGS = {
    "guidance-inf": (["+model.call_kwargs.guidance_scale=inf"], ["model.call_kwargs.guidance_scale: use generate."]),
    "steps-1e8": (["+model.call_kwargs.num_inference_steps=100000000"], ["use generate.num_inference_steps"]),
    "negative": (["+model.call_kwargs.negative_prompt=blur"], ["model.call_kwargs.negative_prompt", "column"]),
    "images": (["+model.call_kwargs.num_images_per_prompt=1000"], ["use generate.images_per_prompt"]),
    "true-cfg-nan": (["+model.call_kwargs.true_cfg_scale=nan"], ["true_cfg_scale=nan", "finite", "0 to 100"]),
    "true-cfg-swept": (
        ["+model.call_kwargs.true_cfg_scale=2", "generate.sweep={true_cfg_scale:[1.0,4.0]}"],
        ["model.call_kwargs.true_cfg_scale", "generate.sweep.true_cfg_scale"],
    ),
    "true-cfg-flux2": (["+model.call_kwargs.true_cfg_scale=4"], ["true_cfg_scale", "(flux2)", "generate.guidance"]),
    "temperature-inf": (["+model.call_kwargs.caption_upsample_temperature=inf"], ["temperature=inf", "finite"]),
    "list-nan": (["model.call_kwargs.text_encoder_out_layers=[1,nan]"], ["text_encoder_out_layers", "finite"]),
    "not-plain": (["+model.call_kwargs.attention_kwargs={scale:2}"], ["attention_kwargs", "not a plain value"]),
    "lora-scale-inf": (["model.loras=[{path:x.safetensors,scale:inf}]"], ["model.loras[0].scale=inf", "finite"]),
}


@pytest.mark.parametrize("case", list(CALL_KWARGS))
def test_call_kwargs_and_scales_outside_the_bounds_are_refused(case, tiny_model, tmp_path, launcher_main, capsys):
    overrides, expected = CALL_KWARGS[case]
    args = [f"model.path={tiny_model}", "mesh.tp=1", f"output.dir={tmp_path / 'out'}", *overrides]
    dry = refused(launcher_main, capsys, ["--dry-run", *args], *expected)
    assert refused(launcher_main, capsys, args) == dry  # the real run says the same line
    assert not (tmp_path / "out").exists()


def test_a_plain_call_kwarg_within_bounds_passes_and_is_recorded(tiny_model):
    """What the pipeline is called with is what run.json fingerprints (model.call_kwargs, as given)."""
    from launcher.checks.settings import check_settings
    from launcher.config import load_config
    from launcher.plan.shards import settings

    over = ["model.call_kwargs.text_encoder_out_layers=[1,2]", "+model.call_kwargs.caption_upsample_temperature=0.7"]
    cfg = load_config("tiny", [f"model.path={tiny_model}", *over])
    check_settings(cfg)
    got = settings(cfg)["model"]["call_kwargs"]
    assert got == {"text_encoder_out_layers": [1, 2], "caption_upsample_temperature": 0.7}


@pytest.fixture(scope="module")
def bad_loras(tiny_model, tmp_path_factory):
    """A LoRA whose lora_B is NaN throughout, and one with a misspelt component prefix and a misspelt block name."""
    import torch
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("bad-loras")
    good = make_lora(tiny_model, d / "good.safetensors", FLUX2, seed=1)
    sd = load_file(str(good))
    nan = dict(sd)
    key = "transformer.transformer_blocks.0.attn.to_q.lora_B.weight"
    nan[key] = torch.full_like(sd[key], float("nan"))
    save_file(nan, str(d / "nan.safetensors"))
    typo = dict(sd)
    for s in ("A", "B"):
        typo[f"transfomer.x_embedder.lora_{s}.weight"] = typo.pop(f"transformer.x_embedder.lora_{s}.weight")
        old = f"transformer.transformer_blocks.0.ff.linear_in.lora_{s}.weight"
        typo[old.replace("blocks", "blokcs")] = typo.pop(old)
    save_file(typo, str(d / "typo.safetensors"))
    return d, sd[key].numel()


@pytest.mark.parametrize("case", ["nan", "typo"])
def test_a_lora_with_non_finite_values_or_unmatched_keys_is_refused(case, bad_loras, tiny_model, launcher_main, capsys):
    d, n = bad_loras
    lora = d / f"{case}.safetensors"
    expected = {
        "nan": [str(lora), "'transformer.transformer_blocks.0.attn.to_q.lora_B.weight'", f"{n} non-finite"],
        # 4 of the 20 keys (7 transformer + 3 text encoder modules, A and B each)
        "typo": [
            str(lora),
            "4 of its 20 keys match no layer",
            "transfomer.x_embedder.lora_A.weight",
            "transformer.transformer_blokcs.0.ff.linear_in.lora_B.weight",
        ],
    }[case]
    args = [f"model.path={tiny_model}", "mesh.tp=1", f"model.loras=[{{path:{lora}}}]", f"output.dir={d / 'out'}"]
    refused(launcher_main, capsys, ["--dry-run", *args], *expected)
    assert not (d / "out").exists()


def test_every_family_declares_the_row_fields_its_pipeline_takes():
    """Held to the real diffusers pipelines' __call__ signatures: `seed` is the generator, the rest by name."""
    import diffusers

    from launcher.models import ROW_FIELDS, families
    from launcher.sources.prompts import OVERRIDE_COLUMNS

    assert set(ROW_FIELDS) == set(OVERRIDE_COLUMNS)
    for fam in families():
        for cls in fam.pipelines:
            params = set(inspect.signature(getattr(diffusers, cls).__call__).parameters) | {"seed"}
            assert set(fam.row_fields) == set(ROW_FIELDS) & params, (fam.name, cls)
            if set(fam.row_fields) != set(ROW_FIELDS) or fam.true_cfg:
                assert fam.row_hint, fam.name  # a refusal says what to do instead


@pytest.fixture(scope="module")
def negatives(tmp_path_factory):
    d = tmp_path_factory.mktemp("negatives")
    rows = [{"id": "a", "prompt": "a red cube"}, {"id": "b", "prompt": "a lake", "negative_prompt": "fog"}]
    (d / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d / "p.jsonl"


def test_a_negative_prompt_column_the_family_ignores_is_refused(negatives, tiny_model, tmp_path, launcher_main, capsys):
    args = [f"model.path={tiny_model}", "mesh.tp=1", f"dataset.path={negatives}", "dataset.id_column=id"]
    expected = [str(negatives), "column 'negative_prompt'", "id 'b'", "FLUX.2 takes no negative prompt"]
    refused(launcher_main, capsys, ["--dry-run", *args, f"output.dir={tmp_path / 'out'}"], *expected)
    refused(launcher_main, capsys, [*args, f"output.dir={tmp_path / 'out'}"], *expected)
    assert not (tmp_path / "out").exists()


def test_flux1_takes_a_negative_prompt_only_with_true_cfg(negatives, tiny_family, tmp_path, launcher_main, capsys):
    base = [
        "model=tiny_flux1",
        f"model.path={tiny_family('flux1')}",
        "mesh.tp=1",
        f"dataset.path={negatives}",
        "dataset.id_column=id",
        f"output.dir={tmp_path / 'out'}",
        "--dry-run",
    ]
    refused(launcher_main, capsys, base, "column 'negative_prompt'", "true_cfg_scale above 1")
    for extra in ("+model.call_kwargs.true_cfg_scale=4.0", "generate.sweep={true_cfg_scale:[1.0,4.0]}"):
        code = launcher_main([*base, extra])
        err = capsys.readouterr().err
        assert code == 0, err[-3000:]
