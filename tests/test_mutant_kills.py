"""Fast tests that kill mutants `make mutants` found surviving: each checks a promise of DESIGN.md or a module's
documented behaviour that no fast test checked, with expected values worked out here from those words, and a fake
pipeline in place of a model (no weights, no workers)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import struct
import types

import numpy as np
import pytest
import torch
from conftest import contract_seed
from omegaconf import OmegaConf
from PIL import Image

from launcher.errors import ConfigError


def job_cfg(**generate):
    gen = {"height": 32, "width": 48, "num_inference_steps": 3, "guidance_scale": 2.5, "batch_size": 2, "seed": 5}
    gen |= {"images_per_prompt": 1, "max_sequence_length": 77} | generate
    model = {"path": "org/model", "call_kwargs": {"not_taken": 1}}
    return OmegaConf.create({"generate": gen, "model": model, "output": {"reference_bytes": False}})


class FakePipeline:
    """A pipeline of no known family (its call's quirks are none) that takes what a text-to-image call takes and
    returns, for each image asked for, an image whose every value is its position in the call / 255."""

    def __init__(self, size=None):
        self.calls = []
        self.size = size  # (h, w) of the images it makes, whatever was asked for (a pipeline that rounds a size)

    def __call__(
        self,
        prompt,
        height,
        width,
        num_inference_steps,
        guidance_scale,
        generator,
        max_sequence_length,
        negative_prompt=None,
        num_images_per_prompt=1,
        output_type="pil",
        image=None,
    ):
        self.calls.append(dict(locals()))
        n = len(prompt) * num_images_per_prompt
        h, w = self.size or (height, width)
        return types.SimpleNamespace(images=np.stack([np.full((h, w, 3), j / 255) for j in range(n)]))


class NoNegativePipeline(FakePipeline):
    def __call__(self, prompt, height, width, num_inference_steps, guidance_scale, generator, max_sequence_length):
        return super().__call__(prompt, height, width, num_inference_steps, guidance_scale, generator, 1)


def test_a_call_gets_its_settings_and_one_cpu_generator_per_image_seeded_from_the_sample_id():
    """DESIGN.md: each sample's seed is sha256("<generate.seed>:<sample id>"); with N images per prompt the ids are
    `<id>-<k>`; the call takes N images of each prompt; a key the pipeline does not take is not passed."""
    from jobs.text_to_image import make_batches, pipeline_kwargs

    cfg = job_cfg(images_per_prompt=2)
    rows = [{"id": "a", "prompt": "p", "negative_prompt": "n"}, {"id": "b", "prompt": "q"}]
    [batch] = make_batches(rows, cfg.generate)
    kw = pipeline_kwargs(FakePipeline(), batch, cfg)
    gens = kw.pop("generator")
    assert [g.device.type for g in gens] == ["cpu"] * 4
    assert [g.initial_seed() for g in gens] == [contract_seed(5, s) for s in ("a-0", "a-1", "b-0", "b-1")]
    assert kw == {
        "prompt": ["p", "q"],
        "height": 32,
        "width": 48,
        "num_inference_steps": 3,
        "guidance_scale": 2.5,
        "max_sequence_length": 77,
        "negative_prompt": ["n", ""],  # a row without one gets the empty prompt
        "num_images_per_prompt": 2,
    }


def test_one_image_per_prompt_and_no_negative_prompts_pass_neither_key():
    from jobs.text_to_image import make_batches, pipeline_kwargs

    cfg = job_cfg()
    [batch] = make_batches([{"id": "a", "prompt": "p"}], cfg.generate)
    kw = pipeline_kwargs(FakePipeline(), batch, cfg)
    assert "num_images_per_prompt" not in kw and "negative_prompt" not in kw
    assert kw["prompt"] == ["p", "p"]  # padded to batch_size with the last row
    [batch] = make_batches([{"id": "a", "prompt": "p", "negative_prompt": "n"}], cfg.generate)
    assert "negative_prompt" not in pipeline_kwargs(NoNegativePipeline(), batch, cfg)  # a pipeline without one


def test_run_batch_asks_for_numpy_images_and_returns_each_real_sample_with_its_model_and_pixels():
    from jobs.text_to_image import make_batches, run_batch

    cfg = job_cfg(images_per_prompt=2, batch_size=3)
    [batch] = make_batches([{"id": "a", "prompt": "p"}, {"id": "b", "prompt": "q"}], cfg.generate)
    pipe = FakePipeline()
    samples = run_batch(pipe, batch, cfg, num_inference_steps=1)
    [call] = pipe.calls
    assert call["output_type"] == "np" and call["num_inference_steps"] == 1  # the warm-up's steps
    # 3 prompts (one padding) x 2 images: the 4 real ones, prompt-major, image j of the call is level j
    assert [(s["id"], s["prompt_id"], s["model"], int(s["pixels"][0, 0, 0])) for s in samples] == [
        ("a-0", "a", "org/model", 0),
        ("a-1", "a", "org/model", 1),
        ("b-0", "b", "org/model", 2),
        ("b-1", "b", "org/model", 3),
    ]
    assert {(s["height"], s["width"], s["seed"]) for s in samples[:1]} == {(32, 48, contract_seed(5, "a-0"))}


def test_non_finite_images_fail_naming_the_first_five_samples_the_count_and_the_model():
    """DESIGN.md: a decoded image made from non-finite values fails its shard."""
    from jobs.text_to_image import NonFiniteOutput, check_finite, make_batches

    cfg = job_cfg(batch_size=8)
    [batch] = make_batches([{"id": f"r{i}", "prompt": "p"} for i in range(7)], cfg.generate)
    values = np.zeros((8, 2, 2, 3))
    check_finite(batch, values, "vae")  # all finite: nothing raised
    values[[0, 1, 2, 3, 4, 5]] = np.nan
    values[7] = np.inf  # the padding row's image is not a sample: never named
    with pytest.raises(NonFiniteOutput) as e:
        check_finite(batch, torch.from_numpy(values), "transformer")
    said = str(e.value)
    assert "the transformer gave non-finite values" in said and "'r0', 'r1', 'r2', 'r3', 'r4' and 1 more" in said
    assert "(6 of 7 in the batch)" in said and "r5" not in said
    assert said.endswith(
        "which would be saved as black images; an overflow in float16 is the usual cause (model.dtype=bfloat16 or "
        "float32 avoids it), else the model's weights"
    ), said


def png(color, size) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def test_an_edit_call_holds_one_row_with_its_references_at_the_rows_size_and_lineage(tmp_path):
    """DESIGN.md: job=edit sends each row's reference images to the pipeline's `image=`, and records each one's
    {id, path, sha256} as the `reference` column; a call holds one row (generate.batch_size does not apply)."""
    from jobs import edit

    cfg = job_cfg(batch_size=4, images_per_prompt=2)
    cfg.output.reference_bytes = True
    refs = [png("red", (8, 4)), png("blue", (4, 4))]
    paths = []
    for i, data in enumerate(refs):
        (tmp_path / f"r{i}.png").write_bytes(data)
        paths.append(str(tmp_path / f"r{i}.png"))
    shas = [hashlib.sha256(d).hexdigest() for d in refs]
    rows = [
        {
            "id": "a",
            "prompt": "p",
            "ref_sha256": " ".join(shas),
            "ref_loc": json.dumps([{"path": f"r{i}.png", "src": p} for i, p in enumerate(paths)]),
        },
        {"id": "b", "prompt": "q", "ref_sha256": shas[1], "ref_loc": json.dumps([{"path": "r1.png", "src": paths[1]}])},
    ]
    batches = edit.shard_batches(rows, cfg)
    assert [(b.n_real, [r["id"] for r in b.rows]) for b in batches] == [(1, ["a"]), (1, ["b"])]
    a = batches[0]
    assert a.lineage == [{"id": "a", "path": f"r{i}.png", "sha256": shas[i]} for i in range(2)]
    pipe = FakePipeline()
    samples = edit.run_batch(pipe, a, cfg)
    [call] = pipe.calls
    assert [im.size for im in call["image"]] == [(48, 32), (48, 32)]  # width x height of the row's bucket
    assert call["image"][0].getpixel((24, 16)) == (255, 0, 0) and call["image"][1].getpixel((0, 0)) == (0, 0, 255)
    assert [len(g) for g in [call["generator"]]] == [2]  # one row, its 2 images
    assert [s["id"] for s in samples] == ["a-0", "a-1"]
    assert all(s["reference"] == a.lineage for s in samples)
    assert samples[0]["reference_image"] == {"bytes": refs[0], "path": "r0.png"}  # output.reference_bytes
    cfg.output.reference_bytes = False
    assert "reference_image" not in edit.run_batch(FakePipeline(), edit.shard_batches(rows, cfg)[1], cfg)[0]
    cfg.generate.reference_fit = "pad"  # docs/guide.md: resized to fit inside, centered on black
    pipe = FakePipeline()
    edit.run_batch(pipe, edit.shard_batches(rows, cfg)[0], cfg)
    padded = pipe.calls[0]["image"][0]  # 8x4 into 48x32: 48x24, 4 rows of black above and below
    assert padded.getpixel((24, 0)) == (0, 0, 0) and padded.getpixel((24, 16)) == (255, 0, 0)


@pytest.mark.parametrize("mode", ["I;16", "I;16L", "I;16B", "I;16N", "I"])
def test_a_16_bit_or_32_bit_grey_reference_is_scaled_by_its_top_byte_in_every_mode(mode):
    """jobs/edit.py: a 16-bit grey reference keeps its whole range (its top byte), in each of PIL's 16-bit modes
    and 32-bit "I"; as RGB. Values beyond 0..65535 (only "I" holds them) are clipped to black and white."""
    from jobs.edit import to_rgb

    values = [0, 255, 256, 0x1234, 0x8000, 65535]
    want = [0, 0, 1, 0x12, 0x80, 255]
    if mode == "I":
        values, want = values + [-5, 70000], want + [0, 255]
    im = Image.new(mode, (len(values), 1))
    for x, v in enumerate(values):
        im.putpixel((x, 0), v)
    out = to_rgb(im)
    assert out.mode == "RGB" and [out.getpixel((x, 0)) for x in range(len(values))] == [(v, v, v) for v in want]


def test_a_cmyk_reference_with_a_damaged_icc_profile_is_one_warning_and_the_plain_conversion(caplog):
    from jobs.edit import to_rgb

    im = Image.new("CMYK", (2, 2), (0, 255, 255, 0))  # red in CMYK
    im.info["icc_profile"] = b"not an icc profile"
    with caplog.at_level("WARNING"):
        out = to_rgb(im)
    assert out.mode == "RGB" and out.getpixel((0, 0)) == Image.new("CMYK", (1, 1), (0, 255, 255, 0)).convert(
        "RGB"
    ).getpixel((0, 0))
    [record] = [r for r in caplog.records if "ICC profile cannot be used" in r.getMessage()]
    assert record.levelname == "WARNING"


def s15(*xs: float) -> bytes:
    return b"".join(struct.pack(">i", round(x * 65536)) for x in xs)


D50 = (0.9642, 1.0, 0.8249)  # the ICC's PCS white
# sRGB's colorants adapted to D50, as sRGB profiles carry them (IEC 61966-2-1 with the ICC's Bradford adaptation)
RED, GREEN, BLUE = (0.4361, 0.2225, 0.0139), (0.3851, 0.7169, 0.0971), (0.1431, 0.0606, 0.7141)


def icc(device_class: bytes, space: bytes, pcs: bytes, tags: dict[bytes, bytes]) -> bytes:
    """An ICC v2 profile (ICC.1:2001-04): a 128-byte header, a tag table, the tags, each 4-byte aligned."""
    text = b"made by a test\0"
    desc = b"desc" + bytes(4) + struct.pack(">I", len(text)) + text + bytes(4 + 4 + 2 + 1 + 67)
    tags = {b"desc": desc, b"wtpt": b"XYZ " + bytes(4) + s15(*D50), **tags}
    offset = 128 + 4 + 12 * len(tags)
    table, body = struct.pack(">I", len(tags)), b""
    for sig, data in tags.items():
        data += bytes(-len(data) % 4)
        table += sig + struct.pack(">II", offset + len(body), len(data))
        body += data
    header = struct.pack(">I", offset + len(body)) + bytes(4) + struct.pack(">I", 0x02100000)
    header += device_class + space + pcs + bytes(12) + b"acsp" + bytes(28) + s15(*D50)
    return header + bytes(128 - len(header)) + table + body


def rgb_profile(r, g, b) -> bytes:
    """A matrix/TRC display profile with these colorants and linear curves."""
    linear, xyz = b"curv" + bytes(8), lambda c: b"XYZ " + bytes(4) + s15(*c)
    curves = {b"rTRC": linear, b"gTRC": linear, b"bTRC": linear}
    return icc(b"mntr", b"RGB ", b"XYZ ", {b"rXYZ": xyz(r), b"gXYZ": xyz(g), b"bXYZ": xyz(b), **curves})


def cmyk_profile_grey_without_black_ink() -> bytes:
    """A CMYK output profile whose A2B0 (lut8Type, 2 grid points an ink) maps every mix with no black ink to
    L*=50.2, a*=b*=0 (Lab bytes 128, 128, 128), and full black to L*=0, whatever the other inks."""
    ramp = bytes(range(256))
    clut = b"".join(bytes([128 if k == 0 else 0, 128, 128]) for _ in range(8) for k in range(2))  # K varies fastest
    lut = b"mft1" + bytes(4) + bytes([4, 3, 2, 0]) + s15(1, 0, 0, 0, 1, 0, 0, 0, 1) + ramp * 4 + clut + ramp * 3
    return icc(b"prtr", b"CMYK", b"Lab ", {b"A2B0": lut})


def test_a_cmyk_reference_goes_through_its_icc_profile():
    """docs/guide.md: CMYK through its embedded ICC profile. This one says any mix without black ink is the
    grey of L*=50.2, which sRGB encodes as 119 (Y = 0.186, 1.055 Y^(1/2.4) - 0.055 = 0.468); PIL's plain
    conversion of the same pixel (no black, full magenta and yellow) is red."""
    from jobs.edit import to_rgb

    im = Image.new("CMYK", (2, 2), (0, 255, 255, 0))
    im.info["icc_profile"] = cmyk_profile_grey_without_black_ink()
    assert all(abs(v - 119) <= 2 for v in to_rgb(im).getpixel((1, 1)))
    assert to_rgb(Image.new("CMYK", (2, 2), (0, 255, 255, 0))).getpixel((1, 1)) == (255, 0, 0)  # no profile


@pytest.mark.parametrize("mode", ["RGB", "RGBA"])
def test_an_rgb_reference_with_a_profile_other_than_srgb_is_brought_to_srgb(mode):
    """An RGB reference is in its embedded profile's colours (a Display P3 photo, an Adobe RGB scan); the models
    take sRGB. This profile's first channel is sRGB's green and its second sRGB's red: full first channel is
    sRGB green, and a half-linear second channel (128 of 255, linear curves) is sRGB red at 188
    (0.502 linear, 1.055 x 0.502^(1/2.4) - 0.055 = 0.735)."""
    from jobs.edit import to_rgb

    swapped = rgb_profile(GREEN, RED, BLUE)
    for value, want in (((255, 0, 0), (0, 255, 0)), ((0, 128, 0), (188, 0, 0))):
        im = Image.new(mode, (3, 2), value if mode == "RGB" else (*value, 40))
        im.info["icc_profile"] = swapped
        out = to_rgb(im)
        pixel = out.getpixel((2, 1))
        assert out.mode == "RGB" and all(abs(a - b) <= 2 for a, b in zip(pixel, want, strict=True)), pixel
        del im.info["icc_profile"]
        assert to_rgb(im).getpixel((2, 1)) == value  # without a profile: as it is


def test_an_icc_profile_of_another_colour_space_is_one_warning_and_the_plain_conversion(caplog):
    """A CMYK profile embedded in an RGB file cannot convert it: PIL's conversion, and a warning naming the mode."""
    from jobs.edit import to_rgb

    im = Image.new("RGB", (2, 2), (10, 20, 30))
    im.info["icc_profile"] = cmyk_profile_grey_without_black_ink()
    with caplog.at_level("WARNING"):
        assert to_rgb(im).getpixel((0, 0)) == (10, 20, 30)
    [record] = [r for r in caplog.records if "ICC profile cannot be used" in r.getMessage()]
    assert "on its RGB pixels" in record.getMessage()


def bands(w: int, h: int, horizontal: bool) -> Image.Image:
    """Three bands, red / green / blue, across (horizontal) or down the image."""
    im = Image.new("RGB", (w, h))
    for i, color in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255)]):
        box = (0, i * h // 3, w, (i + 1) * h // 3) if horizontal else (i * w // 3, 0, (i + 1) * w // 3, h)
        im.paste(color, box)
    return im


def test_crop_keeps_the_middle_of_a_tall_reference_and_pad_centers_it_on_black():
    """generate.reference_fit: `crop` covers the size keeping the aspect ratio, then cuts the middle out; `pad`
    fits it inside, centered on black (the 96x32 wide case is test_runtime_bounds'; here the tall one)."""
    from jobs.edit import fit_image

    cropped = fit_image(bands(32, 96, horizontal=True), 64, 64, "crop")  # 64x192, rows 64..127: the green band
    assert cropped.size == (64, 64)
    assert all(cropped.getpixel((32, y))[1] > 200 and cropped.getpixel((32, y))[0] < 60 for y in (3, 32, 60))
    padded = fit_image(Image.new("RGB", (10, 40), "red"), 40, 40, "pad")  # 10 wide, centered: columns 15..24
    assert padded.getbbox() == (15, 0, 25, 40)


@pytest.mark.parametrize("size, box", [((100, 1), (0, 4, 10, 5)), ((1, 100), (4, 0, 5, 10))])
def test_pad_keeps_a_reference_one_pixel_thin_one_pixel_thin(size, box):
    """A 100:1 reference padded into 10x10 is 10x0.1: at least one pixel, and no more, centered."""
    from jobs.edit import fit_image

    assert fit_image(Image.new("RGB", size, "white"), 10, 10, "pad").getbbox() == box


def test_a_swept_lora_scale_replaces_that_loras_scale_and_the_others_keep_theirs_default_1():
    """DESIGN.md: model.loras is a list of {path, scale} (scale default 1.0); generate.sweep's `lora_scale.<i>` sweeps
    LoRA i; the `lora_scales` column holds every LoRA's scale for the variant."""
    from jobs.text_to_image import shard_batches

    cfg = job_cfg(sweep={"lora_scale.1": [0.25, 2.0]})
    cfg.model.loras = [{"path": "a.safetensors", "scale": 0.5}, {"path": "b.safetensors"}]
    batches = shard_batches([{"id": "x", "prompt": "p"}], cfg)
    assert [(b.variant, b.lora_scales) for b in batches] == [(0, (0.5, 0.25)), (1, (0.5, 2.0))]
    [s] = batches[1].samples(np.zeros((2, 1, 1, 3)))
    assert s["id"] == "x@1" and s["lora_scales"] == [0.5, 2.0]


class CacheTransformer:
    """A transformer with diffusers' step cache: `cache_context(name)` opens the context a cached call runs in."""

    def __init__(self, enabled):
        if enabled is not None:
            self.is_cache_enabled = enabled
        self.opened = []

    def cache_context(self, name):
        self.opened.append(name)
        return contextlib.nullcontext()


def test_a_flux2_call_runs_in_the_step_caches_cond_context_only_when_a_cache_is_on():
    """jobs/text_to_image.py: FLUX.2's pipeline opens no cache context of its own, so the job opens "cond" around the
    call when a step cache is on; never where none is (or the transformer has none)."""
    from jobs.text_to_image import cache_context, make_batches, run_batch

    Flux2Pipeline = type("Flux2Pipeline", (FakePipeline,), {})  # the family is found by the class's name
    for enabled, opened in [(True, ["cond"]), (False, []), (None, [])]:
        pipe = Flux2Pipeline()
        pipe.transformer = CacheTransformer(enabled)
        with cache_context(pipe):
            pass
        assert pipe.transformer.opened == opened
    cfg = job_cfg()
    pipe = Flux2Pipeline()
    pipe.transformer = CacheTransformer(True)
    run_batch(pipe, make_batches([{"id": "a", "prompt": "p"}], cfg.generate)[0], cfg)
    assert pipe.transformer.opened == ["cond"] and len(pipe.calls) == 1
    generic = FakePipeline()  # a family without the quirk: no context, whatever its transformer says
    generic.transformer = CacheTransformer(True)
    with cache_context(generic):
        pass
    assert generic.transformer.opened == []


def test_samples_carry_the_rows_prompt_and_negative_prompt_the_real_size_and_8_bit_pixels():
    """DESIGN.md: `prompt`, `height` and `width` (the size the image really has); `prompt_id` only with N > 1; the
    image as 8-bit pixels."""
    from jobs.text_to_image import make_batches, run_batch

    cfg = job_cfg(batch_size=2)
    [batch] = make_batches(
        [{"id": "a", "prompt": "p", "negative_prompt": "n"}, {"id": "b", "prompt": "q"}], cfg.generate
    )
    samples = run_batch(FakePipeline(size=(16, 12)), batch, cfg)
    assert [(s["id"], s["prompt"], s["negative_prompt"], s["height"], s["width"]) for s in samples] == [
        ("a", "p", "n", 16, 12),
        ("b", "q", None, 16, 12),
    ]
    assert all("prompt_id" not in s for s in samples)  # N = 1 writes no prompt_id
    assert samples[1]["pixels"].dtype == np.uint8 and samples[1]["pixels"].max() == 1  # image 1 is level 1/255
    assert [int(s["pixels"].max()) for s in batch.samples(np.ones((2, 1, 1, 3)))] == [255, 255]  # white is 255


def test_non_finite_decoded_images_name_the_vae_and_the_variant_ids_and_exactly_five_have_no_more():
    from jobs.text_to_image import NonFiniteOutput, make_batches

    cfg = job_cfg(batch_size=5, sweep={"guidance_scale": [1.0, 2.0]})
    batches = make_batches([{"id": f"r{i}", "prompt": "p"} for i in range(5)], cfg.generate)
    with pytest.raises(NonFiniteOutput) as e:
        batches[1].samples(np.full((5, 2, 2, 3), np.nan))
    said = str(e.value)
    assert said.startswith("the vae gave") and "'r0@1', 'r1@1', 'r2@1', 'r3@1', 'r4@1' (5 of 5" in said


def test_each_chunk_of_a_sweep_is_followed_by_its_variants_with_the_chunks_index_and_n_images():
    """jobs/text_to_image.py: each batch of prompts (a chunk) is followed by one batch per variant, the same rows
    and seeds; each keeps generate.images_per_prompt."""
    from jobs.text_to_image import make_batches

    cfg = job_cfg(batch_size=1, images_per_prompt=2, sweep={"num_inference_steps": [2, 5]})
    batches = make_batches([{"id": "a", "prompt": "p"}, {"id": "b", "prompt": "q"}], cfg.generate)
    got = [(b.variant, b.images_per_prompt, b.rows[0]["id"], b.shape[2]) for b in batches]
    assert got == [(0, 2, "a", 2), (1, 2, "a", 5), (0, 2, "b", 2), (1, 2, "b", 5)]
    chunks = [b.chunk for b in batches]  # a chunk's batches share it (and its embeddings), no other batch does
    assert chunks[0] == chunks[1] != chunks[2] == chunks[3]
    assert batches[0].seeds == batches[1].seeds == [contract_seed(5, "a-0"), contract_seed(5, "a-1")]


def test_an_edit_warm_up_call_takes_the_steps_it_is_given(tmp_path):
    from jobs import edit

    cfg = job_cfg()
    (tmp_path / "r.png").write_bytes(data := png("red", (4, 4)))
    row = {"id": "a", "prompt": "p", "ref_sha256": hashlib.sha256(data).hexdigest()}
    row["ref_loc"] = json.dumps([{"path": "r.png", "src": str(tmp_path / "r.png")}])
    pipe = FakePipeline()
    edit.run_batch(pipe, edit.shard_batches([row], cfg)[0], cfg, num_inference_steps=1)
    assert pipe.calls[0]["num_inference_steps"] == 1


def test_a_flux2_call_gets_its_text_encoder_layers_as_a_tuple():
    """launcher/models/flux2.py's call quirk, applied by the job: the pipeline takes text_encoder_out_layers as a
    tuple (a list from the config would not do)."""
    from jobs.text_to_image import make_batches, pipeline_kwargs

    class Flux2Pipeline(FakePipeline):
        def __call__(
            self, prompt, height, width, num_inference_steps, guidance_scale, generator, text_encoder_out_layers
        ):
            raise AssertionError("not called")

    cfg = job_cfg()
    cfg.model.call_kwargs = {"text_encoder_out_layers": [1, 2]}
    kw = pipeline_kwargs(Flux2Pipeline(), make_batches([{"id": "a", "prompt": "p"}], cfg.generate)[0], cfg)
    assert kw["text_encoder_out_layers"] == (1, 2) and isinstance(kw["text_encoder_out_layers"], tuple)


def test_a_reference_stored_in_a_parquet_is_read_from_its_rows_group_past_the_first(tmp_path):
    """DESIGN.md (job=edit): a reference may be an Image struct {bytes, path} in the source; it is read back by row
    when its shard runs. Row 4 of a Parquet of 2-row groups sits in the third group; a row past the end is gone."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from launcher.sources.reference_reads import load_references

    images = [
        [{"bytes": png((i, 0, 0), (2, 2)), "path": f"{i}.png"}, {"bytes": png((0, i, 0), (2, 2)), "path": None}]
        for i in range(6)
    ]
    f = tmp_path / "src.parquet"
    pq.write_table(pa.table({"id": [str(i) for i in range(6)], "image": images}), f, row_group_size=2)
    assert pq.ParquetFile(f).num_row_groups == 3

    def row(n, k):
        data = images[min(n, 5)][k]["bytes"]
        loc = [{"path": f"src.parquet row {n}", "src": [str(f), "image", n, k]}]
        return {"id": str(n), "ref_loc": json.dumps(loc), "ref_sha256": hashlib.sha256(data).hexdigest()}

    for n, k in [(0, 0), (3, 1), (4, 0), (5, 1)]:
        [(lineage, data)] = load_references(row(n, k))
        assert data == images[n][k]["bytes"] and lineage["id"] == str(n)
    with pytest.raises(FileNotFoundError, match="row 6"):
        load_references(row(6, 0))


def test_a_reference_gone_or_changed_since_planning_fails_its_shard_naming_the_file_or_row_and_the_sample(tmp_path):
    """DESIGN.md (job=edit): each reference is read when its shard runs and checked against the sha256 planned; one
    deleted or rewritten since is an error naming it and the row's id (the shard fails, a rerun plans afresh)."""
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    from launcher.sources.reference_reads import load_references

    a, b = tmp_path / "a.png", tmp_path / "b.png"
    a.write_bytes(png((1, 2, 3), (2, 2)))
    b.write_bytes(png((4, 5, 6), (2, 2)))
    f = tmp_path / "src.parquet"
    pq.write_table(pa.table({"image": [{"bytes": b"old", "path": None}] * 3}), f, row_group_size=2)

    def row(*refs):
        locs = [{"path": str(r), "src": str(r)} if isinstance(r, Path) else {"path": "x", "src": r} for r in refs]
        shas = [hashlib.sha256(r.read_bytes() if isinstance(r, Path) else b"old").hexdigest() for r in refs]
        return {"id": "s7", "ref_loc": json.dumps(locs), "ref_sha256": " ".join(shas)}

    planned = row(a, b, [str(f), "image", 2, 0])
    assert [lineage for lineage, _ in load_references(planned)] == [
        {"id": "s7", "path": str(a), "sha256": hashlib.sha256(a.read_bytes()).hexdigest()},
        {"id": "s7", "path": str(b), "sha256": hashlib.sha256(b.read_bytes()).hexdigest()},
        {"id": "s7", "path": "x", "sha256": hashlib.sha256(b"old").hexdigest()},
    ]
    b.write_bytes(png((9, 9, 9), (2, 2)))
    with pytest.raises(ValueError) as e:
        load_references(planned)
    assert str(e.value) == f"reference {b} (row s7) changed since planning; run the same command again"
    pq.write_table(pa.table({"image": [{"bytes": b"new", "path": None}] * 3}), f, row_group_size=2)
    with pytest.raises(ValueError) as e:
        load_references(row(a, [str(f), "image", 2, 0]))
    assert str(e.value) == f"reference {f} row 2 (row s7) changed since planning; run the same command again"
    a.unlink()
    with pytest.raises(FileNotFoundError) as e:
        load_references(planned)
    assert str(e.value) == f"reference {a} (row s7) is missing since planning"


def test_a_done_shards_changed_added_and_removed_prompts_are_named_and_shifted_rows_are_told(tmp_path):
    """DESIGN.md: run.stale decides what happens to done shards whose prompts changed; the refusal names the samples
    whose prompt (or reference image) changed, was added or removed, and tells shifted row numbers (most changed
    prompts still there under other ids) apart."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from launcher.ledger.store import Store
    from launcher.plan.stale import changed_ids

    (tmp_path / "data").mkdir()
    pq.write_table(
        pa.table({"id": ["a", "b", "c"], "prompt": ["pa", "pb", "pc"]}), tmp_path / "data/shard-00003.parquet"
    )
    store = Store(tmp_path)

    def now(ids, prompts, **cols):
        return pa.table({"id": ids, "prompt": prompts, **cols})

    assert changed_ids(store, 3, now(["a", "b", "c"], ["pa", "pb", "pc"])) == ([], False, [])
    assert changed_ids(store, 3, now(["a", "b", "d"], ["pa", "pb2", "pd"])) == (["b", "d", "c"], False, [])
    assert changed_ids(store, 3, now(["a", "b"], ["pb", "pc"])) == (["a", "b", "c"], True, [])  # one row gone above
    assert changed_ids(store, 4, now(["a"], ["pa"])) == ([], False, [])  # no data file: nothing to compare
    assert changed_ids(None, 3, now(["a"], ["x"])) == ([], False, [])

    # N images per prompt: the samples' prompt_id is the prompt's id; an edit job: a reference whose content changed
    ref = [{"id": "a", "path": "r.png", "sha256": "1" * 64}]
    old = {"id": ["a-0", "a-1"], "prompt_id": ["a", "a"], "prompt": ["pa", "pa"], "reference": [ref, ref]}
    pq.write_table(pa.table(old), tmp_path / "data/shard-00005.parquet")
    assert changed_ids(store, 5, now(["a"], ["pa"], ref_sha256=["1" * 64])) == ([], False, [])
    assert changed_ids(store, 5, now(["a"], ["pa"], ref_sha256=["2" * 64])) == (["a"], False, ["r.png"])
    assert changed_ids(store, 5, now(["a"], ["pa2"], ref_sha256=["2" * 64])) == (["a"], False, [])  # the prompt said

    # Shifted when at least half the changed prompts are still there: 1 of 2 is, 1 of 3 is not
    assert changed_ids(store, 3, now(["a", "b", "c"], ["pb", "x", "pc"])) == (["a", "b"], True, [])
    assert changed_ids(store, 3, now(["a", "b", "c"], ["pb", "x", "y"])) == (["a", "b", "c"], False, [])
    assert changed_ids(store, 3, now(["a", "b", "c"], ["pb", "pb", "pc"])) == (["a"], False, [])  # one is no shift
    # Two rows' references changed: both named; a row that lost one of its two references changed, naming none
    two = [{"id": "b", "path": "s.png", "sha256": "3" * 64}, {"id": "b", "path": "t.png", "sha256": "4" * 64}]
    old = {"id": ["a", "b"], "prompt": ["pa", "pb"], "reference": [ref, two]}
    pq.write_table(pa.table(old), tmp_path / "data/shard-00006.parquet")
    moved = now(["a", "b"], ["pa", "pb"], ref_sha256=["2" * 64, f"{'3' * 64} {'5' * 64}"])
    assert changed_ids(store, 6, moved) == (["a", "b"], False, ["r.png", "t.png"])
    assert changed_ids(store, 6, now(["a", "b"], ["pa", "pb"], ref_sha256=["1" * 64, "3" * 64])) == (["b"], False, [])


def _pipeline_folder(root, transformer: bytes, vae: bytes = b"vae weights") -> None:
    """A pipeline folder as model_weights reads it: model_index.json and one safetensors file per component."""
    root.mkdir(parents=True, exist_ok=True)
    index = {"_class_name": "Flux2Pipeline", "transformer": ["diffusers", "X"], "vae": ["diffusers", "Y"]}
    (root / "model_index.json").write_text(json.dumps(index))
    for name, data in (("transformer", transformer), ("vae", vae)):
        (root / name).mkdir(exist_ok=True)
        (root / name / "diffusion_pytorch_model.safetensors").write_bytes(data)


def test_resuming_with_other_weights_or_settings_is_refused_naming_them_and_how_the_work_is_run_is_not(tmp_path):
    """DESIGN, run.json: it fingerprints the model's weights by content and the generation settings, not how the
    work is run; resuming with other settings exits 2. A folder made before this host had the weights is judged
    on the rest, and the weights are recorded when they are here."""
    from launcher.config import load_config
    from launcher.errors import ConfigError
    from launcher.ledger.runs import check_run_json, write_run_json
    from launcher.ledger.store import Store

    model, out = tmp_path / "model", tmp_path / "out"
    store = Store(out)
    cfg = lambda *o: load_config("tiny", [f"model.path={model}", "model.build=null", *o])  # noqa: E731
    write_run_json(store, cfg(), 2)  # the weights are not on this host yet
    assert json.loads((out / "run.json").read_text())["settings"]["model"].get("weights") is None
    _pipeline_folder(model, b"transformer weights 1")
    check_run_json(store, cfg())  # the rest is the same: accepted
    write_run_json(store, cfg(), 2)  # and the weights are recorded now
    recorded = json.loads((out / "run.json").read_text())["settings"]["model"]["weights"]
    assert sorted(recorded) == ["transformer", "vae"]
    check_run_json(store, cfg("generate.batch_size=3", "mesh.tp=1", "dataset.limit=5"))  # how it is run

    with pytest.raises(ConfigError, match=r"other settings \(generate\.seed: 0 -> 6\).*run\.overwrite=true") as e:
        check_run_json(store, cfg("generate.seed=6"))
    assert e.value.exit_code == 2
    with pytest.raises(ConfigError, match=r"another sweep \(generate\.sweep: .*\).*new output\.dir"):
        check_run_json(store, cfg("+generate.sweep={guidance_scale:[1.0,2.0]}"))

    _pipeline_folder(model, b"transformer weights 2, longer")  # the same path, other weights for one component
    with pytest.raises(ConfigError) as e:
        check_run_json(store, cfg())
    message = str(e.value)
    assert f"model.path {model}: the weights of transformer changed since output.dir {out} was made" in message
    assert f"(transformer: sha256 {recorded['transformer'][:12]} -> sha256 " in message and "vae" not in message
    shown = message.split("-> sha256 ")[1][:12]
    assert len(shown) == 12 and shown != recorded["transformer"][:12]
    assert message.endswith("; choose a new output.dir or run.overwrite=true")
    with pytest.raises(ConfigError, match=r"changed since .*; other settings differ too: generate\.seed: 0 -> 6;"):
        check_run_json(store, cfg("generate.seed=6"))


def test_run_json_holds_the_first_config_its_fingerprint_the_shard_count_and_versions_and_grows_with_the_source(
    tmp_path,
):
    """DESIGN, layout: run.json holds the resolved config, its fingerprint, the shard count and the versions. It is
    written when the folder is new and when the source has grown (the count then, and nothing else); a run over
    fewer shards (a lower dataset.limit) or with the same leaves it as it is."""
    import importlib.metadata
    import time as time_

    from launcher.config import load_config
    from launcher.ledger.runs import without_weights, write_run_json
    from launcher.ledger.store import Store

    model, out = tmp_path / "model", tmp_path / "out"
    _pipeline_folder(model, b"transformer weights")
    store = Store(out)
    cfg = lambda *o: load_config("tiny", [f"model.path={model}", "model.build=null", *o])  # noqa: E731
    before = time_.time()
    write_run_json(store, cfg(), 2)
    first = json.loads((out / "run.json").read_text())
    assert first["shards"] == 2 and first["shard_size"] == 8
    assert first["config"] == OmegaConf.to_container(cfg()) and first["config"]["generate"]["batch_size"] == 2
    assert len(first["fingerprint"]) >= 16 and int(first["fingerprint"], 16) >= 0  # hex
    assert sorted(first["settings"]["model"]["weights"]) == ["transformer", "vae"]
    for pkg in ("meshgen", "torch", "diffusers", "transformers"):  # and torch_tpu, where it is installed
        assert first["versions"][pkg] == importlib.metadata.version(pkg)
    created = time_.mktime(time_.strptime(first["created"], "%Y-%m-%dT%H:%M:%S%z"))
    assert before - 2 <= created <= time_.time() + 1
    assert "model_revision" not in first  # a local folder: no hub revision

    # A folder made long ago, with a mark that only a rewrite would drop
    made = {**first, "created": "2026-01-02T03:04:05+0000", "mark": "not rewritten"}
    (out / "run.json").write_text(json.dumps(made))
    for n in (2, 1):  # the same source, or fewer shards of it
        write_run_json(store, cfg("generate.batch_size=3"), n)
        assert json.loads((out / "run.json").read_text()) == made
    write_run_json(store, cfg("generate.batch_size=3"), 5)  # the source grew
    grown = json.loads((out / "run.json").read_text())
    assert grown["shards"] == 5 and grown["created"] == made["created"] and grown["config"] == first["config"]
    assert "mark" not in grown

    # Made before the weights were recorded, with 5 shards: a run over 3 records the weights, the count stays
    (out / "run.json").write_text(json.dumps({**grown, "settings": without_weights(grown["settings"])}))
    write_run_json(store, cfg(), 3)
    again = json.loads((out / "run.json").read_text())
    assert again["shards"] == 5 and again["settings"]["model"]["weights"] == first["settings"]["model"]["weights"]

    # A record that lost its count (edited by hand, or older than the count) is counted again, not trusted
    (out / "run.json").write_text(json.dumps({k: v for k, v in again.items() if k != "shards"}))
    write_run_json(store, cfg(), 1)
    assert json.loads((out / "run.json").read_text())["shards"] == 1


def test_resuming_where_the_weights_are_known_on_one_side_only_is_judged_on_the_rest(tmp_path):
    """DESIGN, run.json: a folder made before its weights were recorded, or a host that has not the model yet, is
    judged on the other settings alone: the same ones resume, others are refused (exit 2) naming each, and the
    weights of each changed component are named with both digests."""
    import shutil

    from launcher.config import load_config
    from launcher.errors import ConfigError
    from launcher.ledger.runs import check_run_json, write_run_json
    from launcher.ledger.store import Store

    model, out = tmp_path / "model", tmp_path / "out"
    store = Store(out)
    cfg = lambda *o: load_config("tiny", [f"model.path={model}", "model.build=null", *o])  # noqa: E731
    other = r"holds a run made with other settings \(generate\.num_inference_steps: 4 -> 5; generate\.seed: 0 -> 6\); "
    other += r"rerun with run\.overwrite=true to discard it, or choose a new output\.dir$"
    bad = ("generate.seed=6", "generate.num_inference_steps=5")
    write_run_json(store, cfg(), 2)  # made before this host had the weights
    _pipeline_folder(model, b"transformer weights 1")
    check_run_json(store, cfg())
    with pytest.raises(ConfigError, match=other):
        check_run_json(store, cfg(*bad))

    shutil.rmtree(out)
    write_run_json(store, cfg(), 2)  # the weights recorded; then a host without the model
    recorded = json.loads((out / "run.json").read_text())["settings"]["model"]["weights"]
    shutil.rmtree(model)
    check_run_json(store, cfg())
    with pytest.raises(ConfigError, match=other):
        check_run_json(store, cfg(*bad))

    _pipeline_folder(model, b"transformer weights 2", b"vae weights 2")  # both components' weights changed
    with pytest.raises(ConfigError) as e:
        check_run_json(store, cfg())
    message = str(e.value)
    assert f"the weights of transformer, vae changed since output.dir {out} was made (transformer: sha256 " in message
    for c in ("transformer", "vae"):
        shown = message.split(f"{c}: sha256 {recorded[c][:12]} -> sha256 ")[1][:12]
        assert len(shown) == 12 and shown != recorded[c][:12], message
    assert f"sha256 {shown}); choose" in message  # vae's the last, with nothing after it
    assert f"; vae: sha256 {recorded['vae'][:12]} -> " in message
    with pytest.raises(ConfigError) as e:
        check_run_json(store, cfg(*bad))
    also = "; other settings differ too: generate.num_inference_steps: 4 -> 5; generate.seed: 0 -> 6; choose"
    assert also in str(e.value), str(e.value)
    assert message.endswith("); choose a new output.dir or run.overwrite=true"), message
    assert "other settings" not in message

    shutil.rmtree(out)
    write_run_json(store, cfg(), 2)
    sweep = r"holds a run made with another sweep \(generate\.seed: 0 -> 6; generate\.sweep: .*\); a changed sweep, "
    sweep += r"grown ones too, numbers its variants anew: choose a new output\.dir for it \(or run\.overwrite=true "
    sweep += r"to discard this one\)$"
    with pytest.raises(ConfigError, match=sweep):
        check_run_json(store, cfg("generate.seed=6", "+generate.sweep={guidance_scale:[1.0,2.0]}"))


def test_a_component_whose_weights_were_not_there_when_the_folder_was_made_is_named_with_none_before(tmp_path):
    """launcher/ledger/runs.py: the weights line names each component that differs, `none` for one that had no
    weights when the folder was made."""
    import shutil

    from launcher.config import load_config
    from launcher.errors import ConfigError
    from launcher.ledger.runs import check_run_json, write_run_json
    from launcher.ledger.store import Store

    model, out = tmp_path / "model", tmp_path / "out"
    _pipeline_folder(model, b"transformer weights")
    shutil.rmtree(model / "vae")
    (model / "model_index.json").write_text(json.dumps({"_class_name": "Flux2Pipeline", "transformer": ["d", "X"]}))
    cfg = load_config("tiny", [f"model.path={model}", "model.build=null"])
    write_run_json(Store(out), cfg, 2)
    _pipeline_folder(model, b"transformer weights", b"vae weights")
    with pytest.raises(ConfigError, match=r"the weights of vae changed since output\.dir .* \(vae: none -> sha256 "):
        check_run_json(Store(out), cfg)


def test_the_stale_refusal_names_five_samples_the_count_beyond_and_the_two_ways_out():
    """A run over done shards whose prompts (or references) changed is refused naming the shards, up to five
    changed samples and how many more, and run.stale=regenerate / keep; without an id column, shifted prompts
    point at dataset.id_column."""
    from launcher.plan.stale import stale_message

    positional = OmegaConf.create({"dataset": {"id_column": None}})
    by_id = OmegaConf.create({"dataset": {"id_column": "uid"}})
    ids = [f"s{i}" for i in range(7)]
    message = stale_message(positional, {3: (ids[:4], False, []), 1: (ids[4:], True, [])})
    assert message == (
        "shards [1, 3] are done but their prompts changed since (samples s0, s1, s2, s3, s4 and 2 more); the "
        "prompts look shifted, as by a line inserted or deleted before them (ids are row numbers): set "
        "dataset.id_column to a column of stable ids so that done work keeps its ids; rerun with "
        "run.stale=regenerate to redo them, or run.stale=keep to keep the old images"
    )
    assert "shifted" not in stale_message(by_id, {1: (ids[4:], True, [])})  # ids are the column's: nothing shifts
    exactly = stale_message(by_id, {0: (ids[:5], False, [])})
    assert "(samples s0, s1, s2, s3, s4);" in exactly  # five: no "more"
    unread = stale_message(by_id, {0: (ids[:2], False, []), 9: None})  # shard 9 not looked at
    assert "shards [0, 9] are done" in unread and "(samples s0, s1 and more);" in unread
    assert "since; rerun" in stale_message(by_id, {2: None})  # nothing looked at: no samples named
    refs = [f"r{i}.png" for i in range(6)]
    message = stale_message(by_id, {0: ([], False, refs[:1]), 1: ([], False, refs[1:])})
    assert "are done but their reference images changed (r0.png, r1.png, r2.png, r3.png, r4.png and more) since;" in (
        message
    )
    assert "(r0.png) since" in stale_message(by_id, {0: ([], False, refs[:1])})


def test_the_prompts_fingerprint_sees_values_not_their_layout():
    """launcher/plan/shards.py prompts_fingerprint: the same values hash the same however Arrow lays them out (a
    slice, several chunks); an all-empty string column is hashed, an all-null one left out; a kept column of any
    other type hashes its type and its values as JSON, dates and structs included, whatever the order of a
    struct's fields."""
    import datetime

    import pyarrow as pa

    from launcher.plan.shards import prompts_fingerprint as fp

    base = {"id": pa.array(["a", "b"]), "prompt": pa.array(["x", "y"])}
    empty = fp(pa.table({**base, "negative_prompt": pa.array(["", ""])}))
    assert fp(pa.table({**base, "negative_prompt": pa.array(["z", "", ""]).slice(1)})) == empty
    assert empty != fp(pa.table(base)) == fp(pa.table({**base, "negative_prompt": pa.array([None, None], pa.string())}))
    chunked = pa.chunked_array([pa.array(["x"]), pa.array(["y"])])
    assert fp(pa.table({"id": base["id"], "prompt": chunked})) == fp(pa.table(base))

    day = [datetime.datetime(2026, 12, 3), datetime.datetime(2026, 12, 4)]
    dated = fp(pa.table({**base, "taken": pa.array(day)}))  # no JSON type: hashed as its text
    assert dated != fp(pa.table({**base, "taken": pa.array([day[0], day[0]])}))
    one = pa.array([{"a": 1, "b": "p"}, {"a": 2, "b": "q"}])
    other_order = pa.array([{"b": "p", "a": 1}, {"b": "q", "a": 2}])
    assert fp(pa.table({**base, "meta": one})) != fp(pa.table({**base, "meta": pa.array([{"a": 1, "b": "p"}] * 2)}))
    # the struct's type names its fields in their order: only the values' JSON is order-free
    assert fp(pa.table({**base, "meta": one})) != fp(pa.table({**base, "meta": other_order}))
    typed = fp(pa.table({**base, "tags": pa.array([[1], [2]], pa.list_(pa.int32()))}))
    assert typed != fp(pa.table({**base, "tags": pa.array([[1], [2]], pa.list_(pa.int64()))}))  # its type is hashed


def test_run_stale_keep_is_recorded_in_done_states_only_and_read_back_as_kept_stale(tmp_path):
    """DESIGN.md run.stale=keep: a kept shard's state records the changed prompts' fingerprint (and the ids that
    changed, where there are ids); the same command finds it done, and status, report and card show it as
    kept-stale: a done state with that record only."""
    from launcher.ledger.states import read_state, state_rel
    from launcher.ledger.store import Store
    from launcher.plan.stale import KEPT, KEPT_IDS, is_kept, kept_stale, record_kept

    store = Store(tmp_path)
    store.write_json(state_rel(0), {"status": "done", "rows": 2})
    store.write_json(state_rel(1), {"status": "failed", "error": "x"})
    store.write_json(state_rel(2), {"status": "done", "rows": 2})
    record_kept(store, {0: "new0", 1: "new1", 2: "new2", 3: "new3"}, {0: ["a", "b"], 2: []})
    states = {i: read_state(store, i) for i in range(4)}
    assert states[0] == {"status": "done", "rows": 2, KEPT: "new0", KEPT_IDS: ["a", "b"]}
    assert states[1] == {"status": "failed", "error": "x"} and states[3] is None  # only done shards are kept
    assert states[2] == {"status": "done", "rows": 2, KEPT: "new2"}  # no ids changed there: none recorded
    assert is_kept(states[0], "new0") and not is_kept(states[0], "new2")
    assert [kept_stale(states[i]) for i in range(4)] == [True, False, True, False]
    assert not kept_stale({"status": "failed", KEPT: "x"}) and not kept_stale({}) and not kept_stale({"status": "done"})


def test_the_stale_refusal_reads_the_first_stale_shards_until_five_samples_are_named(tmp_path):
    """launcher/plan/stale.py refuse: the refusal names up to five changed samples, read from the first stale
    shards in turn, and reads no further shard once five are named (a shard not read makes it "and more")."""
    from types import SimpleNamespace

    import pyarrow as pa
    import pyarrow.parquet as pq

    from launcher.errors import ConfigError
    from launcher.ledger.store import Store
    from launcher.plan.stale import refuse

    (tmp_path / "data").mkdir()
    changes = {0: 4, 1: 1, 2: 1}  # shard -> how many of its 6 prompts changed: 4, then the fifth, then one unread
    tables = {}
    for shard, n in changes.items():
        ids = [f"{'abc'[shard]}{k}" for k in range(6)]
        old = pa.table({"id": ids, "prompt": [f"prompt {i}" for i in ids]})
        pq.write_table(old, tmp_path / "data" / f"shard-{shard:05d}.parquet")
        tables[shard] = pa.table(
            {"id": ids, "prompt": [f"new {i}" if k < n else f"prompt {i}" for k, i in enumerate(ids)]}
        )
    cfg = SimpleNamespace(dataset=SimpleNamespace(id_column="id"))

    def message(stale, tables):
        with pytest.raises(ConfigError) as e:
            refuse(cfg, Store(tmp_path), stale, tables)
        return str(e.value)

    tail = "; rerun with run.stale=regenerate to redo them, or run.stale=keep to keep the old images"
    assert message([0, 1, 2], tables) == (
        f"shards [0, 1, 2] are done but their prompts changed since (samples a0, a1, a2, a3, b0 and more){tail}"
    )
    assert (
        message([0, 1], tables)
        == f"shards [0, 1] are done but their prompts changed since (samples a0, a1, a2, a3, b0){tail}"
    )
    assert message([2, 0], tables) == (
        f"shards [0, 2] are done but their prompts changed since (samples c0, a0, a1, a2, a3){tail}"
    )
    # a stale shard whose rows were not kept for the comparison is not read, and makes it "and more"
    assert message([1, 3], {1: tables[1]}) == (
        f"shards [1, 3] are done but their prompts changed since (samples b0 and more){tail}"
    )


def test_a_done_shard_that_only_left_out_rows_set_aside_then_is_told_from_one_whose_rows_changed(tmp_path):
    """launcher/sources/rejected.py: a run writes the rows it set aside to rejected/<run id>.parquet; a later run
    reads it back, and a done shard whose state is its rows now less those (and less the rows set aside now) has
    only grown by fixed rows. Any other difference, a state without a run id, or a file that cannot be read, is
    not that."""
    import pyarrow as pa

    from launcher.ledger.store import Store
    from launcher.plan.shards import prompts_fingerprint as fp
    from launcher.sources import rejected

    store = Store(tmp_path)
    rows = lambda *ks: pa.table({"id": [f"r{k}" for k in ks], "prompt": [f"p{k}" for k in ks]})  # noqa: E731
    # shard 1 of size 4 holds positions 4-7; the run "r" set aside positions 5 and 7 there, and 2 of shard 0
    bad = [
        {"file": "a.txt", "line": p + 1, "position": p, "shard": p // 4, "id": f"r{p}", "reason": "x"}
        for p in (2, 5, 7)
    ]
    rejected.write(store, "r", bad)
    assert (tmp_path / "rejected" / "r.parquet").exists()
    rejected.write(store, "empty", [])
    assert not (tmp_path / "rejected" / "empty.parquet").exists()  # nothing set aside: no file
    now = rows(4, 5, 6, 7)
    state = {"run_id": "r", "prompts_fingerprint": fp(rows(4, 6))}
    assert rejected.was_without(store, state, 1, now, 4, fp)
    assert not rejected.was_without(store, {**state, "prompts_fingerprint": fp(rows(4, 5, 6))}, 1, now, 4, fp)
    assert not rejected.was_without(store, {"prompts_fingerprint": state["prompts_fingerprint"]}, 1, now, 4, fp)
    assert not rejected.was_without(None, state, 1, now, 4, fp)
    assert not rejected.was_without(store, state, 2, rows(8, 9), 4, fp)  # the run set nothing aside in shard 2
    # position 7 is still bad now (its `rejected` column set): left out of both sides
    marked = now.append_column(rejected.FIELD, pa.array([None, None, None, '{"where": "w", "reason": "y"}']))
    assert rejected.was_without(store, {**state, "prompts_fingerprint": fp(rows(4, 6))}, 1, marked, 4, fp)
    still_bad = now.append_column(rejected.FIELD, pa.array([None, '{"where": "w", "reason": "y"}', None, None]))
    assert rejected.was_without(store, state, 1, still_bad, 4, fp)
    (tmp_path / "rejected" / "r.parquet").write_bytes(b"PAR1 damaged")
    assert not rejected.was_without(store, state, 1, now, 4, fp)


def test_split_takes_a_shards_accepted_rows_and_records_each_set_aside_row_where_it_is():
    """A shard's rows with their `rejected` column: the accepted ones without it, and for each rejected one its
    file and line (from "dataset FILE, line N" or "row N"), its position in the source, its shard, id and reason."""
    import pyarrow as pa

    from launcher.sources import rejected

    why = lambda where: json.dumps({"where": where, "reason": "too long"})  # noqa: E731
    table = pa.table(
        {
            "id": ["a", "b", "c", "d"],
            "prompt": ["pa", "pb", "pc", "pd"],
            "rejected": [None, why("dataset x.jsonl, line 7"), None, why("dataset y.parquet, row 3")],
        }
    )
    good, out = rejected.split(table, 2, 4)
    assert good.column_names == ["id", "prompt"] and good["id"].to_pylist() == ["a", "c"]
    assert out == [
        {"file": "x.jsonl", "line": 7, "position": 9, "shard": 2, "id": "b", "reason": "too long"},
        {"file": "y.parquet", "line": 3, "position": 11, "shard": 2, "id": "d", "reason": "too long"},
    ]
    same, none = rejected.split(table.drop_columns(["rejected"]), 0, 4)
    assert none == [] and same.num_rows == 4
    clean = table.set_column(2, rejected.FIELD, pa.nulls(4, pa.string()))
    good, out = rejected.split(clean, 0, 4)
    assert out == [] and good.column_names == ["id", "prompt"] and good.num_rows == 4


@pytest.mark.parametrize(
    "source, output, inside",
    [
        ("/d/**/*.parquet", "/d/out", True),  # `**`: any depth, the output's data/*.parquet would match
        ("/d/**/*.parquet", "/d/a/b/out", True),
        ("/d/**/*.parquet", "/d/.cache/out", False),  # `**` never enters a folder whose name starts with "."
        ("/d/.*/*.parquet", "/d/.cache", True),  # a part that starts with "." does
        ("/d/.*/*.parquet", "/d/.cache/out", False),  # and lists the files of /d/.cache only
        ("/d/*/*.parquet", "/d/out", True),  # lists every folder one below /d
        ("/d/*/*.parquet", "/d/a/out", False),  # `*` does not cross "/"
        ("/d/s?c/*.txt", "/d/src", True),
        ("/d/s?c/*.txt", "/d/sxyc", False),
        ("/d/[ab]/*.txt", "/d/b/x", False),  # the files of /d/b only, not of its folders
        ("/d/[ab]/*.txt", "/d/c", False),
        ("/d/**", "/d/deep/out", True),  # a trailing `**` reaches everything below
        ("/d", "/d/out", True),  # a folder read whole (save_to_disk, an earlier run's folder)
        ("/d", "/e/out", False),
        ("/d", "/d", True),
        ("/d/src/p.parquet", "/d/src/out", False),  # a file reaches only itself
        ("/d/src/p.parquet", "/d", True),  # ... which the output folder would hold
        ("/d/src/P.TXT", "/d/src/out", False),  # a prompt file's suffix in any case
        ("/d/src/p.parquet", "/d/src", True),  # the output folder holds the file itself
        ("s3://b/d/p.txt", "s3://b/d/p.txt/out", False),  # a store's key may also be a folder: the file's alone read
        ("/d/*.parquet", "/d/run.parquet", False),  # the glob lists /d's files; a folder it matches is not read
        ("/*/x.parquet", "/d", True),  # a glob from the root: its first folder part lists /d
        ("/**/x.parquet", "/d/out", True),
        ("/d/**/.cache/*.parquet", "/d/.cache", True),  # `**` may match no folder at all
        ("/d/**/*.parquet", "/d/a/.cache", False),  # ... nor enter a "." folder below the first either
        ("/d/**/*.parquet", "/d/a/.cache/out", False),
        ("/d/*/*.parquet", "/d/.cache", False),  # `*` matches no name that starts with "."
        ("s3://b/d/**/*.parquet?endpoint_override=http://h:9000", "s3://b/d/out", True),  # a URL in the query
        ("s3://b/d", "s3:/b/d/out", False),  # a local folder named "s3:" is not the bucket
        ("/dX/*/*.parquet", "/d/out", False),  # names are compared whole: /dX is not /d
        ("/d/*/X", "/d/out", True),
        ("s3://b/d/**/*.parquet", "s3://b/dX", False),
        ("s3://b/my data/**/*.parquet", "s3://b/my data/out", True),  # a space is part of a key
        ("s3://b/d?endpoint_override=http://h:9000", "s3://b/d/out", True),  # a folder's query is not its name
        ("s3://b/d/", "s3://b/d/out", True),  # a folder named with its trailing "/"
        ("s3://b/d?endpoint_override=http://h:9000/?x", "s3://b/d/out", True),  # the query from the first "?"
        ("s3://b/d/**/*.parquet", "s3://b/d/out", True),
        ("s3://b/d/**/*.parquet?endpoint_override=x", "s3://b/d/out/", True),  # query and trailing "/" dropped
        ("s3://b/d/**/*.parquet", "gs://b/d/out", False),  # another store
        ("s3://b/d/*.parquet", "s3://b/d/out", False),
        ("s3://b/d", "s3://b/d/out", True),
        ("s3://b/d/**/*.parquet", "/b/d/out", False),
    ],
)
def test_the_reach_of_a_dataset_path_is_what_glob_would_list(source, output, inside):
    """launcher/sources/reach.py and DESIGN (globs mean what Python's glob means): an output folder the source could
    read from is refused, naming both and the fix; one outside it is accepted."""
    from launcher.errors import ConfigError
    from launcher.sources.reach import check_output_outside_source, reaches

    assert reaches(source, output) is inside
    if inside:
        with pytest.raises(ConfigError) as e:
            check_output_outside_source(source, output)
        assert str(e.value) == (
            f"output.dir {output} is inside dataset.path {source}'s reach: its files would be read back as prompts; "
            "choose an output.dir outside it"
        )
    else:
        check_output_outside_source(source, output)


def test_the_reach_of_a_glob_through_a_link_is_the_folder_it_leads_to(tmp_path):
    """reach.py: on local disk both sides are resolved first, so a glob whose base is a link reaches the output
    folder named by its real path, and the other way round."""
    from launcher.sources.reach import reaches

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert reaches(f"{tmp_path}/link/**/*.parquet", f"{tmp_path}/real/out") is True
    assert reaches(f"{tmp_path}/real/**/*.parquet", f"{tmp_path}/link/out") is True
    assert reaches(f"{tmp_path}/link/*.parquet", f"{tmp_path}/real/out") is False


GOOD_STATE = {"status": "done", "rows": 2, "seconds": 1.5, "run_id": "r", "stages": {"denoise": 1, "vae": 0.5}}


@pytest.mark.parametrize(
    "data, why",
    [
        (b"", "empty"),
        (b"  \n", "empty"),
        (b'{"status": "do', "not JSON (Unterminated string starting at: line 1 column 12 (char 11))"),
        (b"[1, 2]", "a JSON list, not an object"),
        (b'"done"', "a JSON str, not an object"),
        (b'{"rows": 2}', "status None is neither 'done' nor 'failed'"),
        (b'{"status": "pending"}', "status 'pending' is neither 'done' nor 'failed'"),
        (b'{"status": "done", "rows": true}', "'rows' is 'True'"),  # a bool is no count
        (b'{"status": "done", "rows": 2.0}', "'rows' is '2.0'"),
        (b'{"status": "done", "seconds": "1"}', "'seconds' is '1'"),
        (b'{"status": "failed", "error": 3}', "'error' is '3'"),
        (b'{"status": "done", "samples": {}}', "'samples' is '{}'"),
        (
            b'{"status": "done", "run_id": "' + b"x" * 50 + b'", "prompts_fingerprint": 7}',
            "'prompts_fingerprint' is '7'",
        ),
        (b'{"status": "done", "attempt": ["' + b"y" * 50 + b'"]}', "'attempt' is \"['" + "y" * 38 + '"'),
        (b'{"status": "done", "stages": {"a": 1, "b": "2"}}', "'stages' holds a value that is not a number"),
        (b'{"status": "done", "stages": {"a": true}}', "'stages' holds a value that is not a number"),
        (b'{"status": "done", "files": {"data/a.parquet": []}}', "'files' holds 'data/a.parquet': []"),
        (
            b'{"status": "done", "files": {"data/a.parquet": [1, "h", 3]}}',
            "'files' holds 'data/a.parquet': [1, 'h', 3]",
        ),
        (b'{"status": "done", "files": {"data/a.parquet": ["1"]}}', "'files' holds 'data/a.parquet': ['1']"),
        (b'{"status": "done", "files": {"data/a.parquet": [1, 2]}}', "'files' holds 'data/a.parquet': [1, 2]"),
        (b'{"status": "done", "files": {"images/s/": [3, "x"]}}', "'files' holds 'images/s/': [3, 'x']"),
        (b'{"status": "done", "files": {"images/s/": [3]}}', "'files' holds 'images/s/': [3]"),
        (b'{"status": "done", "files": {"data/./a": [1]}}', "'files' holds 'data/./a': [1]"),
        (b'{"status": "done", "files": {"data/a/b/c": [1]}}', "'files' holds 'data/a/b/c': [1]"),
        (b'{"status": "done", "files": {"logs/a": [1]}}', "'files' holds 'logs/a': [1]"),
    ],
)
def test_a_state_file_that_is_not_a_state_is_damaged_and_says_why(data, why):
    """launcher/ledger/states.py: an empty, cut, non-object or mistyped state file makes its shard not done, and
    the status and the report name what is wrong with it."""
    from launcher.ledger.states import parse_state

    assert parse_state(data) == (None, why)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"status": "failed", "error": "boom", "attempts": 2},
        {"files": {"data/shard-00001.parquet": [10, "ab"], "images/s1/a.png": [4, "cd"]}},
        {"files": {"data/shard-00001.parquet": [10]}},  # as the index keeps it
        {"files": {"images/shard-00001/": [3, 120], "webdataset/shard-00001.tar": [5]}},  # a folder: [count, bytes]
        {"rows": None, "finished_at": 1700000000, "images_per_s": 2},  # null and whole numbers where numbers go
    ],
)
def test_a_sound_state_is_read_as_it_is(extra):
    from launcher.ledger.states import parse_state

    state = {**GOOD_STATE, **extra}
    assert parse_state(json.dumps(state).encode()) == (state, None)


def test_a_run_lock_on_disk_names_its_holder_beats_and_is_free_again_once_released(tmp_path, monkeypatch):
    """DESIGN: one live run per (output folder, worker index); a refused launch exits 4 naming the holder. On disk
    the record is rewritten at each heartbeat (a watcher sees it change) and emptied at release."""
    import os
    import socket
    import time

    from launcher.errors import LockHeld
    from launcher.ledger import lock as lock_mod
    from launcher.ledger.store import Store

    monkeypatch.setattr(lock_mod, "HEARTBEAT_S", 0.01)
    store = Store(tmp_path)
    first = lock_mod.RunLock(store, 3, "run-a")
    assert lock_mod.look(store, 3) == (None, False)
    first.acquire()
    path = tmp_path / "locks" / "worker-00003.lock"
    record = json.loads(path.read_text())
    assert {k: record[k] for k in ("host", "pid", "run_id")} == {
        "host": socket.gethostname(), "pid": os.getpid(), "run_id": "run-a"}  # fmt: skip
    # Its pid's namespace, so that a watcher on this machine judges the pid (a dead holder is taken over at once),
    # and when it started, as ISO 8601 with the offset (the refusal names it).
    assert record["pid_space"] == lock_mod.PID_SPACE and time.strptime(record["started"], "%Y-%m-%dT%H:%M:%S%z")
    assert lock_mod.look(store, 3) == (json.loads(path.read_text()), True) and first.held()
    deadline = time.monotonic() + 60
    while json.loads(path.read_text())["beat"] < 3:  # the heartbeat rewrites it
        assert time.monotonic() < deadline, "no heartbeat"
        time.sleep(0.01)
    assert lock_mod.run_alive(store, 3, "run-a") and not lock_mod.run_alive(store, 3, "run-b")
    assert lock_mod.live_run_ids(store) == {"run-a"} and lock_mod.other_live_runs(store, 3) == []
    assert [r["worker"] for r in lock_mod.other_live_runs(store, 4)] == [3]
    with pytest.raises(LockHeld) as e:
        lock_mod.RunLock(store, 3, "run-b").acquire()
    started = json.loads(path.read_text())["started"]
    assert e.value.exit_code == 4 and str(e.value) == (
        f"another run is active on {store} (workers.index=3): host {socket.gethostname()}, pid {os.getpid()}, "
        f"started {started}; wait for it to finish or stop it"
    )
    with lock_mod.RunLock(store, 4, "run-c"):  # another worker index: its own lock
        assert lock_mod.live_run_ids(store) == {"run-a", "run-c"}
    assert lock_mod.live_run_ids(store) == {"run-a"}
    # Only the locks lock_rel names count, a worker index past five digits too; a dead run's record does not.
    (tmp_path / "locks" / "worker-00005.lock").write_text(json.dumps({"run_id": "run-dead", "pid": 1}))
    for stranger in ("worker-abc.lock", "worker-7.lock", "worker-000006.lock", "worker-00008.json", "notes.txt"):
        (tmp_path / "locks" / stranger).write_text(json.dumps({"run_id": "run-x"}))
    with lock_mod.RunLock(store, 123456, "run-d"):
        assert lock_mod.live_run_ids(store) == {"run-a", "run-d"}
        assert sorted(r["worker"] for r in lock_mod.other_live_runs(store, 3)) == [123456]
    assert (tmp_path / "locks" / "worker-123456.lock").exists()
    first.release()
    assert path.read_bytes() == b"" and lock_mod.look(store, 3) == (None, False)
    beats = path.stat().st_mtime_ns
    time.sleep(0.05)
    assert path.stat().st_mtime_ns == beats  # the heartbeat stopped with the release
    with lock_mod.RunLock(store, 3, "run-b") as second:
        assert json.loads(path.read_text())["run_id"] == "run-b" and second.held()


@pytest.mark.parametrize("batches", [[10], [3, 5, 1, 1], [4, 4, 2], [1] * 10, [7, 3]])
@pytest.mark.parametrize("limit", [None, 1, 4, 5, 9, 10, 11])
def test_shards_are_cut_by_row_position_whatever_the_batches_and_dataset_limit_keeps_the_first_rows(
    batches, limit, monkeypatch
):
    """DESIGN/rejected.py: shard i holds rows i*size ... (i+1)*size-1 of the source, wherever the reader's batches
    end; dataset.limit keeps the first `limit` rows (a shard it cuts keeps its whole rows beside them), and no
    shard starts at or past it."""
    import pyarrow as pa

    from launcher.plan import plan as plan_mod

    def read_batches(src):
        start = 0
        for n in batches:
            yield pa.RecordBatch.from_pydict({"id": [str(i) for i in range(start, start + n)]})
            start += n

    monkeypatch.setattr(plan_mod, "read_batches", read_batches)
    got = [(i, t["id"].to_pylist(), w["id"].to_pylist()) for i, t, w in plan_mod.shard_tables(None, 4, limit)]
    shown = 10 if limit is None else min(limit, 10)
    expected = []
    for i in range(0, shown, 4):
        whole = [str(k) for k in range(i, min(i + 4, 10))]
        expected.append((i // 4, [k for k in whole if int(k) < shown], whole))
    assert got == expected


def test_a_shards_status_from_its_state_and_its_rows_now():
    """done | failed | pending | stale (done, but its prompts changed) | grown (done, and rows were appended); a
    shard done in full is done under a lower dataset.limit; run.stale=keep keeps exactly the prompts it kept."""
    import pyarrow as pa

    from launcher.plan.plan import shard_status
    from launcher.plan.shards import prompts_fingerprint as fp

    rows = lambda *ks: pa.table({"id": [f"r{k}" for k in ks], "prompt": [f"p{k}" for k in ks]})  # noqa: E731
    done = lambda t, **kw: {"status": "done", "prompts_fingerprint": fp(t), "rows": t.num_rows, **kw}  # noqa: E731
    four = rows(0, 1, 2, 3)
    assert shard_status(None, four, four, fp(four)) == "pending"
    assert shard_status({"status": "failed", "error": "x"}, four, four, fp(four)) == "failed"
    assert shard_status(done(four), four, four, fp(four)) == "done"
    edited = pa.table({"id": ["r0", "r1", "r2", "r3"], "prompt": ["p0", "p1", "CHANGED", "p3"]})
    assert shard_status(done(four), edited, edited, fp(edited)) == "stale"
    two = rows(0, 1)
    assert shard_status(done(two), four, four, fp(four)) == "grown"  # two rows appended to a short last shard
    assert shard_status(done(two), edited.slice(0, 3), edited.slice(0, 3), fp(edited.slice(0, 3))) == "grown"
    assert shard_status(done(rows(0, 9)), four, four, fp(four)) == "stale"  # not a beginning of the rows now
    # images_per_prompt=2: "rows" counts images, "prompts" the prompts
    assert shard_status(done(two, rows=4, prompts=2), four, four, fp(four)) == "grown"
    assert shard_status(done(four), four.slice(0, 3), four, fp(four.slice(0, 3))) == "done"  # limit cuts it
    assert shard_status(done(four), two, rows(0, 1, 7, 8), fp(two)) == "stale"  # its whole rows changed
    kept = {**done(four), "kept_fingerprint": fp(edited)}  # run.stale=keep kept it for the edited prompts
    assert shard_status(kept, edited, edited, fp(edited)) == "done"
    again = pa.table({"id": ["r0", "r1", "r2", "r3"], "prompt": ["p0", "p1", "CHANGED AGAIN", "p3"]})
    assert shard_status(kept, again, again, fp(again)) == "stale"  # not for prompts changed since


def test_the_exact_reader_names_a_bad_rows_place_what_is_wrong_and_the_fix():
    """DESIGN, bad rows: refused at planning naming the row; per-row height and width are checked against the
    model's size factor and pixel limit (a row giving one of the two takes the other from the config)."""
    from launcher.errors import ConfigError
    from launcher.sources.prompts import SizeRule, Source
    from launcher.sources.prompts_exact import _exact_row

    sizes = SizeRule(multiple=16, max_pixels=1024 * 1024, height=512, width=256)
    src = Source("d.jsonl", id_column="uid", sizes=sizes)
    at = "dataset d.jsonl, line 4"

    def refusal(row, source=src):
        with pytest.raises(ConfigError) as e:
            _exact_row(at, row, 3, source)
        return str(e.value)

    assert _exact_row(at, {"uid": "a", "prompt": "p", "width": 512}, 3, src) == {"id": "a", "prompt": "p", "width": 512}
    assert _exact_row(at, {"prompt": "p", "seed": 7}, 3, Source("d.txt")) == {"id": "3", "prompt": "p", "seed": 7}
    assert refusal({"uid": "a", "text": "p", "n": 1}) == (
        f"{at} has no prompt column 'prompt' (dataset.prompt_column); columns found: uid, text, n"
    )
    assert refusal({}) == f"{at} has no prompt column 'prompt' (dataset.prompt_column); columns found: none"
    assert refusal({"prompt": 5, "uid": "a"}) == f"{at}: the prompt ('prompt') is of type int, not text; fix that row"
    assert refusal({"prompt": "x" * (64 * 1024 + 1), "uid": "a"}).startswith(f"{at}: the prompt ('prompt') is ")
    assert refusal({"prompt": "p", "id": "a"}) == (
        f"{at} has no id column 'uid' (dataset.id_column); columns found: prompt, id; fix the row or set "
        "dataset.id_column=null"
    )
    assert refusal({"prompt": "p", "uid": None}) == (
        f"{at}: the id ('uid') is missing (null); give the row an id or remove the row"
    )
    assert refusal({"prompt": "p", "uid": ""}).startswith(f"{at}: ")
    assert refusal({"prompt": "p", "uid": "a", "height": 520}) == (
        f"{at}: height 520 is not a multiple of 16 (this model's size factor); use e.g. 512 (or leave the row's "
        "height and width empty)"
    )
    assert refusal({"prompt": "p", "uid": "a", "width": 8}) == (
        f"{at}: width 8 is not a multiple of 16 (this model's size factor); use e.g. 16 (or leave the row's height "
        "and width empty)"
    )
    # 2048 wide at the config's height 512: 1.0 megapixels, fine; 4096 wide: 2.0, over the limit
    assert _exact_row(at, {"prompt": "p", "uid": "a", "width": 2048}, 3, src)["width"] == 2048
    assert refusal({"prompt": "p", "uid": "a", "width": 4096}) == (
        f"{at}: 4096x512 is 2.0 megapixels, more than the 1.0 this model family allows; use a smaller size (or "
        "leave the row's height and width empty)"
    )
    assert _exact_row(at, {"prompt": "p", "uid": "a", "height": 4096}, 3, src)["height"] == 4096  # 1.0: at it


def test_the_csv_reader_numbers_each_record_by_its_line_and_names_what_is_wrong(tmp_path):
    """A CSV source: a header, then one record per line (a quoted field may span lines: the record is named by its
    first line); a blank line is no row; a record with another number of fields, or a line that is not UTF-8, is
    a bad row at its own line; an empty cell of a per-row setting is no value. Read from an old end, the lines go
    on being numbered from there, under the file's header."""
    from launcher.errors import ConfigError
    from launcher.sources.prompts_raw import _csv
    from launcher.sources.row_checks import Bad

    f = tmp_path / "p.csv"
    body = b'prompt,seed\n"a cat",1\n\n"two\nlines",\nx,y,z\n\xff\xfe,3\n"q\n\xff",4\nlast,5\n'
    f.write_bytes(body)
    got = [(w, r.reason if isinstance(r, Bad) else r) for w, r in _csv(str(f), "prompt")]
    where = lambda n: f"dataset {f}, line {n}"  # noqa: E731
    assert got == [
        (where(2), {"prompt": "a cat", "seed": "1"}),
        (where(4), {"prompt": "two\nlines", "seed": None}),
        (where(6), "expected 2 fields (prompt, seed), got 3; fix that line (quote fields that hold commas)"),
        (where(7), "not UTF-8 text (invalid start byte at byte 0); save the file as UTF-8"),
        (where(9), "not UTF-8 text (invalid start byte at byte 0); save the file as UTF-8"),  # inside a record
        (where(10), {"prompt": "last", "seed": "5"}),
    ]
    old_end = body.index(b"last")
    assert [w for w, _ in _csv(str(f), "prompt", old_end)] == [where(10)]
    assert list(_csv(str(f), "prompt", len(body))) == []  # nothing after the old end

    f.write_bytes(b"text,seed\nhello,1\n")
    with pytest.raises(ConfigError) as e:
        list(_csv(str(f), "prompt"))
    assert str(e.value) == (
        f"dataset {f} has no prompt column 'prompt' (dataset.prompt_column); columns found: text, seed"
    )
    f.write_bytes(b"prompt,\xffseed\nhello,1\n")
    with pytest.raises(ConfigError) as e:
        list(_csv(str(f), "prompt"))
    assert str(e.value) == f"dataset {f}, line 1: not UTF-8 text (invalid start byte at byte 7); save the file as UTF-8"
    f.write_bytes(b"")
    assert list(_csv(str(f), "prompt")) == []
    f.write_bytes(b"prompt,seed\n\xff\rx,1\nlast,5\n")  # a lone CR in a line that is not UTF-8: still one line
    got = [(w, r.reason if isinstance(r, Bad) else r) for w, r in _csv(str(f), "prompt")]
    assert got == [(where(2), "not UTF-8 text (invalid start byte at byte 0); save the file as UTF-8"),
                   (where(3), {"prompt": "last", "seed": "5"})]  # fmt: skip


@pytest.mark.parametrize(
    "sweep, says",
    [
        ({"num_inference_steps": [1, 1000, 4.0]}, None),  # DESIGN's bounds, at their edges; 4.0 is whole
        ({"num_inference_steps": [0]}, "generate.sweep.num_inference_steps: value 0 must be in 1..1000"),
        ({"num_inference_steps": [1001]}, "generate.sweep.num_inference_steps: value 1001 must be in 1..1000"),
        ({"num_inference_steps": [2.5]}, "generate.sweep.num_inference_steps: value 2.5 is not a whole number"),
        ({"height": [16, 4096]}, None),  # sizes: the family's limits are checked with the model
        ({"width": [0]}, "generate.sweep.width: value 0 must be at least 1"),
        ({"guidance_scale": [0, 100, 0.5]}, None),
        ({"guidance_scale": [-0.5]}, "generate.sweep.guidance_scale: value -0.5 must be in 0..100"),
        ({"true_cfg_scale": [100.5]}, "generate.sweep.true_cfg_scale: value 100.5 must be in 0..100"),
        ({"guidance_scale": [float("inf")]}, "generate.sweep.guidance_scale: value inf is not a finite number"),
        ({"guidance_scale": [True]}, "generate.sweep.guidance_scale: value True is not a number"),
        ({"height": ["512"]}, "generate.sweep.height: value '512' is not a number"),
        ({"lora_scale.0": [-100, 100, 0]}, None),
        ({"lora_scale.0": [-100.5]}, "generate.sweep.lora_scale.0: value -100.5 must be in -100..100"),
        ({"lora_scale.1": [1.0]}, "generate.sweep.lora_scale.1: model.loras has no entry 1 (1 LoRAs configured)"),
        ({"guidance_scale": [2, 2.0]}, "generate.sweep.guidance_scale: value 2.0 is listed twice"),
        ({"guidance_scale": []}, "generate.sweep.guidance_scale=[] must be a non-empty list of values"),
        ({"seed": [1]}, "generate.sweep.seed: unknown sweep key; sweep one of guidance_scale, num_inference_steps"),
        ([1, 2], "generate.sweep=[1, 2] must map keys to lists"),
    ],
)
def test_a_sweep_is_checked_key_by_key_against_the_configs_bounds(sweep, says):
    """DESIGN: every value bounded; a sweep's values have the bounds of the config value they set (exit 2 naming
    the key and the value)."""
    from launcher.errors import ConfigError
    from launcher.plan.sweep import check_sweep

    gen = {"sweep": sweep}
    loras = [{"path": "a.safetensors", "scale": 1.0}]
    if says is None:
        check_sweep(gen, loras)
        return
    with pytest.raises(ConfigError) as e:
        check_sweep(gen, loras)
    assert str(e.value).startswith(says), str(e.value)


def test_credentials_anywhere_in_the_config_are_refused_naming_the_key_with_the_secret_masked(monkeypatch):
    """launcher/ledger/addresses.py: an address with user information or a credential query value, at any depth
    of the composed config (a list item included) or in an S3 endpoint of the environment, is exit 2 naming where
    it is, the secret masked; a Hub address only where something reads it."""
    from omegaconf import OmegaConf

    from launcher.errors import ConfigError
    from launcher.ledger.addresses import WHERE, check_config

    def refusal(cfg: dict) -> str:
        with pytest.raises(ConfigError) as e:
            check_config(OmegaConf.create(cfg))
        return str(e.value)

    check_config(OmegaConf.create({"output": {"dir": "s3://b/run"}, "model": {"loras": [{"path": "a/b"}]}}))
    assert refusal({"output": {"dir": "s3://KEY:SECRET@b/run"}}) == (
        f"output.dir=s3://***@b/run carries credentials in its address; remove them from it and {WHERE}"
    )
    assert refusal({"model": {"loras": [{"path": "ok"}, {"path": "https://u:pw@host/x.safetensors"}]}}) == (
        f"model.loras[1].path=https://***@host/x.safetensors carries credentials in its address; remove them from "
        f"it and {WHERE}"
    )
    assert refusal({"dataset": {"path": "s3://b/p.txt?region=x&secret_key=abc123"}}).startswith(
        "dataset.path=s3://b/p.txt?region=x&secret_key=*** carries credentials"
    )
    assert refusal({"output": {"dir": "hf://datasets/o/n"}}) == (
        "output.dir=hf://datasets/o/n: a Hub address is not read or written here; a run folder is a local path, "
        "gs:// or s3://; push its dataset to the Hub with output.publish=hf://datasets/ORG/NAME or tools/publish"
    )
    assert refusal({"model": {"path": "hf://o/n"}}) == (
        "model.path=hf://o/n: a Hub address is not read or written here; give the Hub's id as ORG/NAME, without hf://"
    )
    check_config(
        OmegaConf.create({"dataset": {"path": "hf://datasets/o/n"}, "output": {"publish": "hf://datasets/o/m"}})
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://user1:pass1@127.0.0.1:9000")
    assert refusal({"output": {"dir": "s3://b/run"}}) == (
        f"AWS_ENDPOINT_URL_S3=http://***@127.0.0.1:9000 carries credentials in its address; remove them from it "
        f"and {WHERE}"
    )


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_kept_columns_are_attached_row_for_row_across_files_and_read_chunks(tmp_path, monkeypatch, suffix):
    """DESIGN, dataset.keep_columns: source columns carried into every output with their types. They are read in
    a pass of their own, in chunks: each prompt batch gets exactly its own rows' values, wherever a file or a
    chunk ends inside it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from launcher.sources import keep
    from launcher.sources.prompts import Source

    monkeypatch.setattr(keep, "_READ_ROWS", 3)
    files, k = [], 0
    for name, n in (("a", 7), ("b", 5)):
        rows = [{"prompt": f"p{k + i}", "cat": f"c{k + i}", "n": k + i} for i in range(n)]
        f = tmp_path / f"{name}.{suffix}"
        if suffix == "parquet":
            pq.write_table(pa.Table.from_pylist(rows), f)
        else:
            f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        files.append(str(f))
        k += n
    src = Source(f"{tmp_path}/*.{suffix}", keep_columns=("n", "cat"))
    kept = keep.Kept(src, files)
    assert [(x.name, x.type) for x in kept.fields] == [("n", pa.int64()), ("cat", pa.string())]
    got, at = [], 0
    for size in (4, 4, 0, 1, 3):  # 12 rows: batches that end inside files and chunks, and an empty one
        batch = pa.RecordBatch.from_pydict({"id": [str(i) for i in range(at, at + size)]})
        out = kept.attach(batch)
        assert out.schema.names == ["id", "n", "cat"] and out.num_rows == size
        got += out.to_pylist()
        at += size
    assert got == [{"id": str(i), "n": i, "cat": f"c{i}"} for i in range(12)]


def test_kept_columns_that_do_not_fit_the_first_files_types_or_are_missing_are_named(tmp_path):
    import pyarrow as pa

    from launcher.errors import ConfigError
    from launcher.sources import keep
    from launcher.sources.prompts import Source

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"prompt": "x", "n": 1}\n')
    b.write_text('{"prompt": "y", "n": "many"}\n')
    src = Source(f"{tmp_path}/*.jsonl", keep_columns=("n",))
    kept = keep.Kept(src, [str(a), str(b)])
    kept.attach(pa.RecordBatch.from_pydict({"id": ["0"]}))
    with pytest.raises(ConfigError) as e:
        kept.attach(pa.RecordBatch.from_pydict({"id": ["1"]}))
    assert str(e.value).startswith(
        f"dataset.keep_columns: {b} holds values that are not of the first file's types (n: int64): "
    )
    with pytest.raises(ConfigError) as e:
        keep.kept_fields(Source(str(a), keep_columns=("city",)), (str(a),))
    assert str(e.value) == f"dataset.keep_columns: {a} has no column 'city'; columns found: prompt, n"
    with pytest.raises(ConfigError) as e:
        keep.kept_names(Source(str(a), keep_columns="n"), [str(a)])
    assert str(e.value) == "dataset.keep_columns='n': give a list of column names, or all"
    assert keep.kept_names(Source(str(a), keep_columns="all"), [str(a)]) == ("n",)
    t = tmp_path / "t.txt"  # a .txt source has no columns: `all` keeps none, a named one is not there
    t.write_text('{"n": 1}\n')
    assert keep.kept_names(Source(str(t), keep_columns="all"), [str(t)]) == ()
    with pytest.raises(ConfigError) as e:
        keep.kept_fields(Source(str(t), keep_columns=("n",)), (str(t),))
    assert str(e.value) == f"dataset.keep_columns: {t} has no column 'n'; columns found: none"
    mixed = keep.Kept(Source(f"{tmp_path}/*", keep_columns=("n",)), [str(a), str(t)])  # a glob over both kinds
    mixed.attach(pa.RecordBatch.from_pydict({"id": ["0"]}))
    with pytest.raises(ConfigError) as e:
        mixed.attach(pa.RecordBatch.from_pydict({"id": ["1"]}))
    assert str(e.value) == f"dataset.keep_columns: {t} is a .txt file: it has no columns to keep"


def _png(path, w: int, h: int) -> bytes:
    """A w x h PNG written to `path`; its bytes."""
    path.write_bytes(data := png((10, 20, 30), (w, h)))
    return data


def test_a_reference_is_hashed_whole_and_checked_against_the_edit_pipelines_bounds(tmp_path, monkeypatch):
    """launcher/sources/reference_checks.py: a reference is an image, not cut short, within the family's pixels,
    at least 64 px a side and at most 8:1 (diffusers' edit pipelines' own bounds), and read within a size bound;
    each failure is one line naming the row, the file and the fix. Its hash is the sha256 of all its bytes."""
    from launcher.errors import ConfigError
    from launcher.sources import reference_checks as rc

    monkeypatch.setattr(rc, "_CHUNK", 100)  # several chunks per file
    at, mp = "dataset d.jsonl, line 3", 1 << 20

    def refusal(path, max_pixels=mp):
        with pytest.raises(ConfigError) as e:
            rc.hash_file(str(path), at, max_pixels)
        return str(e.value)

    ok = tmp_path / "ok.png"
    data = _png(ok, 64, 512)  # 8:1 and 64 px: at both bounds
    assert rc.hash_file(str(ok), at, mp) == (hashlib.sha256(data).hexdigest(), (64, 512))
    assert refusal(ok, 64 * 511) == (
        f"{at}: reference {ok} is 64x512 (0.0 megapixels), more than the 0.0 this model family takes; downscale it"
    )
    assert refusal(tmp_path / "gone.png") == (
        f"{at}: reference {tmp_path / 'gone.png'} does not exist; fix the path (relative paths start at the source "
        "file's folder)"
    )
    small = tmp_path / "small.png"
    _png(small, 63, 100)
    assert refusal(small) == (
        f"{at}: reference {small} is 63x100; the edit pipelines take images of at least 64 px a side and at most "
        "8:1; use a larger image or crop it"
    )
    thin = tmp_path / "thin.png"
    _png(thin, 64, 513)
    assert refusal(thin).startswith(f"{at}: reference {thin} is 64x513; the edit pipelines take")
    text = tmp_path / "text.png"
    text.write_text("not an image")
    assert refusal(text).startswith(f"{at}: reference {text} is not an image (")
    cut = tmp_path / "cut.png"
    cut.write_bytes(data[: len(data) - 30])  # its header and part of its pixels
    assert refusal(cut).startswith(f"{at}: reference {cut} is damaged or cut short (")
    monkeypatch.setattr(rc, "DECODE_BYTES", len(data) - 30)  # decoded in full up to this size, and at it
    assert refusal(cut).startswith(f"{at}: reference {cut} is damaged or cut short (")
    monkeypatch.setattr(rc, "DECODE_BYTES", len(data) - 31)  # past it only the header is read: what a run finds
    assert rc.hash_file(str(cut), at, mp)[1] == (64, 512)
    monkeypatch.setattr(rc, "DECODE_BYTES", 8 << 20)
    big = tmp_path / "big.png"
    _png(big, 1024, 1024)
    assert rc.hash_file(str(big), at, 1 << 20)[1] == (1024, 1024)  # at the family's limit
    assert refusal(big, 1 << 19) == (
        f"{at}: reference {big} is 1024x1024 (1.0 megapixels), more than the 0.5 this model family takes; downscale it"
    )
    monkeypatch.setattr(rc, "MAX_BYTES", len(data) - 1)
    assert refusal(ok) == (
        f"{at}: reference {ok} is larger than 0 MiB, more than an image within this family's 1.0 megapixels needs; "
        "use a smaller file"
    )
    rc.check_output_size(at, 64, 512, None)
    rc.check_output_size(at, None, None, None)  # no size yet and no model known: nothing to refuse
    with pytest.raises(ConfigError) as e:
        rc.check_output_size(at, 512, 63, None)
    assert str(e.value) == (
        f"{at}: the edit pipeline takes references at the output size, 63x512 here, which must be at least 64 px a "
        "side and at most 8:1; use such a height and width"
    )


def test_a_lock_objects_holder_is_judged_by_the_watchers_own_clock_and_the_stores(tmp_path, monkeypatch):
    """launcher/ledger/liveness.py: a first look ages a lock by the store's clock (its LastModified against a probe
    written now); later looks by the watcher's monotonic clock since the bytes last changed; a rewrite is life; a
    holder that is a dead process of this machine is dead at once; no record, or an unreadable one, is no holder."""
    import os
    import time

    from launcher.ledger import liveness
    from launcher.ledger.store import Store

    store, rel = Store(tmp_path), "locks/worker-00000.json"
    clock = [1000.0]
    monkeypatch.setattr(liveness.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(liveness, "_seen", {})
    record = {"host": "h", "pid": 12345, "run_id": "r", "beat": 1}  # another machine's process: not judged by pid
    store.write_bytes(rel, json.dumps(record).encode())
    assert liveness.watch(store, rel, 60) == (record, True)  # written just now by the store's clock
    clock[0] += 59
    assert liveness.watch(store, rel, 60)[1] is True
    clock[0] += 2  # 61 s of the watcher's clock without a change
    assert liveness.watch(store, rel, 60) == (record, False)
    record["beat"] = 2
    store.write_bytes(rel, json.dumps(record).encode())
    assert liveness.watch(store, rel, 60) == (record, True)  # rewritten: alive, watched from now
    clock[0] += 61
    assert liveness.watch(store, rel, 60)[1] is False

    monkeypatch.setattr(liveness, "_seen", {})  # a first look at a lock last written 120 s ago by the store's clock
    old = time.time() - 120
    os.utime(tmp_path / rel, (old, old))
    assert liveness.watch(store, rel, 60) == (record, False)
    assert liveness.watch(store, rel, 600) == (record, True)

    monkeypatch.setattr(liveness, "_seen", {})
    dead = {**record, "pid": 2**22 + 7, "pid_space": liveness.PID_SPACE}  # this machine's, not running
    store.write_bytes(rel, json.dumps(dead).encode())
    assert liveness.watch(store, rel, 60) == (dead, False)
    mine = {**record, "pid": os.getpid(), "pid_space": liveness.PID_SPACE}
    store.write_bytes(rel, json.dumps(mine).encode())
    assert liveness.watch(store, rel, 60) == (mine, True)
    store.write_bytes(rel, b"{not json")
    assert liveness.watch(store, rel, 60) == (None, False)
    store.delete(rel)
    assert liveness.watch(store, rel, 60) == (None, False)


@pytest.mark.parametrize(
    "content, why",
    [
        (b"{not json", "not JSON: "),
        (b"\xff\xfe", "not JSON: "),
        (b"[1, 2]", "no fingerprint and settings"),
        (b'{"fingerprint": 5, "settings": {}}', "no fingerprint and settings"),
        (b'{"fingerprint": "ab", "settings": []}', "no fingerprint and settings"),
        (b'{"settings": {}}', "no fingerprint and settings"),
    ],
)
def test_a_run_json_meshgen_did_not_write_keeps_the_folder_from_being_taken_as_a_run(tmp_path, content, why):
    """A folder whose run.json is not meshgen's (a project's own file of that name) is refused naming why: a resume
    would crash on it and run.overwrite would delete the folder's files. An empty folder, or files only in the
    folders a run makes first, are a new run's; a folder with another file is not meshgen's."""
    from launcher.errors import ConfigError
    from launcher.ledger.runs import check_ours, read_run_json
    from launcher.ledger.store import Store

    store = Store(tmp_path)
    (tmp_path / "run.json").write_bytes(content)
    with pytest.raises(ConfigError) as e:
        check_ours(store)
    message = str(e.value)
    assert message.startswith(f"output.dir {store} holds a run.json that meshgen did not write ({why}")
    assert message.endswith(
        "); choose an empty or new folder (or remove that run.json if the folder is a meshgen run's)"
    )
    (tmp_path / "run.json").write_text('{"fingerprint": "ab", "settings": {}}')
    assert read_run_json(store) == {"fingerprint": "ab", "settings": {}}
    check_ours(store)


def test_a_folder_that_is_not_meshgens_is_refused_naming_three_of_its_entries(tmp_path):
    from launcher.errors import ConfigError
    from launcher.ledger.runs import check_ours
    from launcher.ledger.store import Store

    store = Store(tmp_path)
    check_ours(store)  # empty
    for early in ("locks", "claims", "plans", "logs", "runs", "state"):
        (tmp_path / early).mkdir()
    (tmp_path / "locks" / "worker-00000.lock").write_text("")
    (tmp_path / "mnt").mkdir()  # an empty folder (a mount point made for the run) holds nothing a run changes
    check_ours(store)
    for name in ("README.md", "a.txt", "b.txt", "c.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "mnt" / "deep").mkdir()
    with pytest.raises(ConfigError) as e:
        check_ours(store)
    assert str(e.value) == (
        f"output.dir {store} is not empty and is not a meshgen folder (no run.json; it holds README.md, a.txt, "
        "b.txt and 1 more); choose an empty or new folder"
    )


def test_a_stale_shards_changed_ids_are_read_from_its_parquet_and_a_shift_is_told(tmp_path):
    """The stale refusal names the samples whose prompts changed, were added or removed, read from the done
    shard's Parquet (prompt_id where a prompt has several samples); when most changed prompts are still there under
    other ids, the rows look shifted; an edit job's changed reference images are named by path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from launcher.ledger.store import Store
    from launcher.plan.stale import changed_ids

    store = Store(tmp_path)
    (tmp_path / "data").mkdir()
    rows = lambda ids, prompts: pa.table({"id": ids, "prompt": prompts})  # noqa: E731
    assert changed_ids(store, 2, rows(["0"], ["a"])) == ([], False, [])  # no data file: nothing to compare
    assert changed_ids(None, 2, rows(["0"], ["a"])) == ([], False, [])
    samples = pa.table({"id": ["4-0", "4-1", "5-0", "5-1", "6-0", "6-1", "7-0", "7-1"],
                        "prompt_id": ["4", "4", "5", "5", "6", "6", "7", "7"],
                        "prompt": ["a", "a", "b", "b", "c", "c", "d", "d"]})  # fmt: skip
    pq.write_table(samples, tmp_path / "data" / "shard-00001.parquet")
    assert changed_ids(store, 1, rows(["4", "5", "6", "7"], ["a", "B", "c", "d"])) == (["5"], False, [])
    assert changed_ids(store, 1, rows(["4", "5", "6"], ["a", "b", "c"])) == (["7"], False, [])  # removed
    assert changed_ids(store, 1, rows(["4", "5", "6", "7", "8"], list("abcde"))) == (["8"], False, [])  # added
    shifted = changed_ids(store, 1, rows(["4", "5", "6", "7"], ["new", "a", "b", "c"]))  # a line inserted above
    assert shifted == (["4", "5", "6", "7"], True, [])
    assert changed_ids(store, 1, rows(["4", "5", "6", "7"], ["x", "y", "c", "d"]))[1] is False  # edits, no shift

    ref = lambda path, sha: {"path": path, "sha256": sha}  # noqa: E731
    refs = [[ref("a.png", "s1")], [ref("b.png", "s2"), ref("c.png", "s3")]]
    edit = pa.table({"id": ["0", "1"], "prompt": ["p", "q"], "reference": refs})
    pq.write_table(edit, tmp_path / "data" / "shard-00000.parquet")
    now = pa.table({"id": ["0", "1"], "prompt": ["p", "q"], "ref_sha256": ["s1", "s2 sX"]})
    assert changed_ids(store, 0, now) == (["1"], False, ["c.png"])
    now = pa.table({"id": ["0", "1"], "prompt": ["p", "Q"], "ref_sha256": ["s1", "s2 sX"]})
    assert changed_ids(store, 0, now) == (["1"], False, [])  # its prompt changed: the row is named, not its images


def test_a_host_whose_name_holds_the_temporary_mark_cleans_its_own_leftovers(tmp_path, monkeypatch):
    """A temporary name is `.<name>.tmp-<host>-<pid>`: the first mark ends the shard's own name, and a host named
    node.tmp-cluster is still this host (read from the last mark, it was a host `cluster`, whose files stay)."""
    import os

    from launcher.ledger import states
    from launcher.ledger.store import Store

    monkeypatch.setattr(states, "HOST", "node.tmp-cluster")
    dead = tmp_path / "data" / ".shard-00003.parquet.tmp-node.tmp-cluster-4194315"  # above Linux's pid_max
    alive = tmp_path / "data" / f".shard-00003.parquet.tmp-node.tmp-cluster-{os.getpid()}"
    dead.parent.mkdir()
    dead.write_bytes(b"x")
    alive.write_bytes(b"x")
    states.clean_tmp(Store(tmp_path), 3)
    assert not dead.exists() and alive.exists()


def test_the_index_inflates_to_its_limit_and_no_further_and_is_written_only_when_it_would_say_something_new(
    tmp_path, monkeypatch
):
    """launcher/ledger/states.py: inflate takes a gzip stream of exactly `limit` bytes, refuses one byte more
    (holding at most that much: a bomb costs the limit, not its size) and a stream that is not gzip's; save_index
    writes once for what is new, and a sound index is read without a state file."""
    import gzip
    import tracemalloc
    import zlib

    from launcher.ledger.states import INDEX, INDEX_BYTES_PER_STATE, Ledger, inflate, state_rel
    from launcher.ledger.store import Store

    payload = b"0123456789" * 100
    assert inflate(gzip.compress(payload), 1000) == payload
    with pytest.raises(ValueError) as e:
        inflate(gzip.compress(payload), 999)
    assert str(e.value) == f"it inflates past 999 bytes, more than {INDEX_BYTES_PER_STATE} per listed state file"
    with pytest.raises(EOFError, match="^it ends before its gzip stream does$"):
        inflate(gzip.compress(payload)[:-20], 1000)
    with pytest.raises(zlib.error, match="incorrect header check"):
        inflate(zlib.compress(payload), 1000)  # zlib's own format: not the gzip one the index is written in
    bomb = gzip.compress(bytes(32 * 2**20))
    tracemalloc.start()
    with pytest.raises(ValueError, match="inflates past 1024 bytes"):
        inflate(bomb, 1024)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2**20, peak

    store = Store(tmp_path)
    for i in range(2):
        store.write_json(state_rel(i), {"status": "done", "rows": 2})
    writes = []
    real = Store.write_bytes
    monkeypatch.setattr(Store, "write_bytes", lambda self, rel, data: (writes.append(rel), real(self, rel, data)))
    ledger = Ledger(store)
    ledger.refresh()
    ledger.save_index()
    ledger.save_index()  # nothing new
    ledger.refresh()
    ledger.save_index()  # still nothing new
    assert writes == [INDEX]
    again = Ledger(store)
    assert sorted(again.refresh()) == [0, 1] and again.reads == 0
    again.save_index()  # what it read is what the index says
    assert writes == [INDEX]


def test_leftovers_of_dead_writers_go_and_live_ones_and_other_hosts_recent_ones_stay(tmp_path, monkeypatch):
    """launcher/ledger/states.py clean_tmp: a temporary name carries its writer's host and pid. This host's
    leftovers go when their pid is dead; another host's (a folder shared over NFS) only once unchanged for the
    lock's STALE_S by the store's clock; only the asked shard's, or every shard's; files and image folders, and a
    claim's write cut short (tests/test_faults.py's lost host left one in a clean clone's make test)."""
    import os
    import time

    from launcher.ledger.lock import STALE_S
    from launcher.ledger.states import clean_tmp
    from launcher.ledger.store import HOST, Store

    store = Store(tmp_path)
    dead_pid = 2**22 + 11  # above Linux's pid_max: never a live process
    names = {
        "data/.shard-00001.parquet.tmp-{h}-{p}": (HOST, dead_pid),
        "state/.shard-00001.json.tmp-{h}-{p}": (HOST, os.getpid()),  # alive: this test
        "images/.shard-00001.tmp-{h}-{p}": (HOST, dead_pid),  # an uncommitted image folder
        "webdataset/.shard-00002.tar.tmp-{h}-{p}": (HOST, dead_pid),  # another shard
        # another host's, recent: its pid is dead here, and means nothing here
        "data/.shard-00001.parquet.tmp-{h}-{p}#recent": ("other-node", dead_pid),
        "data/.shard-00001.parquet.tmp-{h}-{p}#old": ("old-node", dead_pid),  # another host's, old
        "data/.shard-00001.parquet.tmp-{p}": ("", dead_pid),  # a name from before hosts were in it
        # a claim's write cut short (a host killed mid-claim): claims/shard-<i>/.g<N>.json.tmp-<host>-<pid>
        "claims/shard-00001/.g00000.json.tmp-{h}-{p}": (HOST, dead_pid),
        "claims/shard-00001/.g00001.json.tmp-{h}-{p}": (HOST, os.getpid()),
        "claims/shard-00002/.g00000.json.tmp-{h}-{p}": (HOST, dead_pid),
        "claims/shard-00001/g00000.json": (HOST, dead_pid),  # a claim, not a temporary file
    }
    paths = {}
    for pattern, (h, p) in names.items():
        path = tmp_path / pattern.split("#")[0].format(h=h, p=p).replace("tmp--", "tmp-")  # #: a second name
        path.parent.mkdir(parents=True, exist_ok=True)
        if "images/" in pattern:
            path.mkdir()
            (path / "a.png").write_bytes(b"x")
        else:
            path.write_bytes(b"x")
        paths[pattern] = path
    old = time.time() - STALE_S - 30
    os.utime(paths["data/.shard-00001.parquet.tmp-{h}-{p}#old"], (old, old))
    clean_tmp(store, 1)
    left = {k for k, p in paths.items() if p.exists()}
    assert left == {
        "state/.shard-00001.json.tmp-{h}-{p}",
        "webdataset/.shard-00002.tar.tmp-{h}-{p}",  # not shard 1's
        "data/.shard-00001.parquet.tmp-{h}-{p}#recent",
        "claims/shard-00001/.g00001.json.tmp-{h}-{p}",
        "claims/shard-00002/.g00000.json.tmp-{h}-{p}",
        "claims/shard-00001/g00000.json",
    }
    clean_tmp(store)  # every shard's
    assert {k for k, p in paths.items() if p.exists()} == {
        "state/.shard-00001.json.tmp-{h}-{p}",
        "data/.shard-00001.parquet.tmp-{h}-{p}#recent",
        "claims/shard-00001/.g00001.json.tmp-{h}-{p}",
        "claims/shard-00001/g00000.json",
    }


FAST_CASES = {  # (suffix, bytes, whether the fast reader must read it itself)
    "plain txt": ("txt", "".join(f"prompt {i}\n" for i in range(7)).encode(), True),
    "txt, CRLF, BOM, blank lines": ("txt", b"\xef\xbb\xbfa\r\n\r\nb\rc\n  \nd", True),
    "txt with a tab and U+2028": ("txt", "a\tb\nc\u2028d\n".encode(), None),
    "plain csv": ("csv", b"prompt,seed\n" + b"".join(b"p%d,%d\n" % (i, i) for i in range(7)), True),
    "csv, quoted newline and comma": ("csv", b'prompt,seed\n"a,\nb",1\nc,\n', None),
    "csv, empty cells": ("csv", b"prompt,seed,negative_prompt\nx,,\ny,3,no\n", None),
    "csv, bad int": ("csv", b"prompt,seed\nx,1.5\n", False),
    "plain jsonl": ("jsonl", b"".join(b'{"prompt": "p%d", "seed": %d}\n' % (i, i) for i in range(7)), True),
    "jsonl with a BOM": ("jsonl", b'\xef\xbb\xbf{"prompt": "a"}\n{"prompt": "b"}\n', True),
    "jsonl, nulls and floats": (
        "jsonl",
        b'{"prompt": "a", "guidance_scale": 3}\n{"prompt": "b", "seed": null}\n',
        None,
    ),
}


@pytest.mark.parametrize("case", FAST_CASES)
def test_the_fast_reader_yields_what_the_exact_reader_does_or_gives_up(case, tmp_path, monkeypatch):
    """launcher/sources/prompts_fast.py: it yields exactly the rows the exact reader would, batch boundaries
    anywhere, or gives up; a plain file it reads itself."""
    from launcher.sources import prompts, prompts_fast
    from launcher.sources.prompts import Source, _GiveUp

    monkeypatch.setattr(prompts_fast, "BATCH_ROWS", 3)
    suffix, data, fast_reads = FAST_CASES[case]
    f = tmp_path / f"p.{suffix}"
    f.write_bytes(data)
    src = Source(str(f))
    try:
        batches = list(prompts_fast.fast_batches(str(f), src, 10))
    except _GiveUp:
        assert fast_reads is not True, f"{case}: the fast reader gave up on a plain file"
        return
    assert fast_reads is not False, f"{case}: the fast reader read what it cannot judge"
    exact = [{k: v for k, v in r.items() if v is not None} for r in prompts._exact_rows(str(f), src, 10)]
    fast = [{k: v for k, v in r.items() if v is not None} for b in batches for r in b.to_pylist()]
    assert fast == exact
    if suffix == "txt":  # read in chunks of BATCH_ROWS lines (CSV and JSON lines in pyarrow's blocks)
        assert [b.num_rows for b in batches] == [3] * (len(exact) // 3) + ([len(exact) % 3] if len(exact) % 3 else [])


def test_a_grown_text_file_is_read_from_its_old_end_by_the_fast_reader_as_by_the_exact_one(tmp_path):
    """A nightly .txt source that grew is read from its old end (docs/operations.md), its rows numbered on from the
    old ones; a U+FEFF there is text, as it is anywhere but at the start of the file."""
    from launcher.sources import prompts
    from launcher.sources.prompts_fast import fast_batches

    f, old = tmp_path / "p.txt", b"\xef\xbb\xbfa\nb\n"
    f.write_bytes(old + "\ufeffc\nd\n".encode())
    src = prompts.Source(str(f))
    fast = [(r["id"], r["prompt"]) for b in fast_batches(str(f), src, 2, len(old)) for r in b.to_pylist()]
    exact = [(r["id"], r["prompt"]) for r in prompts._exact_rows(str(f), src, 2, len(old))]
    assert fast == exact == [("2", "\ufeffc"), ("3", "d")]


SIZED = {  # rows of a JSON lines source -> whether the fast reader must give up (the exact reader judges them)
    "sizes that fit": ([{"height": 64, "width": 32}, {"height": 128}, {"width": 48}], False),
    "a height off the multiple": ([{"height": 64}, {"height": 72}], True),
    "a width off the multiple": ([{"width": 17}], True),
    "over the pixel limit": ([{"height": 64, "width": 64}, {"height": 4096, "width": 4096}], True),
    "seed 0, one step": ([{"seed": 0, "num_inference_steps": 1}], False),
    "zero steps": ([{"seed": 5}, {"num_inference_steps": 0}], True),
    "a negative seed": ([{"seed": -1}], True),
    "steps past the bound": ([{"num_inference_steps": 10**6}], True),
    "guidance as text": ([{"guidance_scale": "7"}], True),
    "ids of 1 and 200 bytes": ([{"id": "a"}, {"id": "é" * 100}], False),
    "an empty id": ([{"id": "a"}, {"id": ""}], True),
    "an id of 201 bytes": ([{"id": "b" * 201}], True),
    "an id with a control character": ([{"id": "a\x07b"}], True),
}


@pytest.mark.parametrize("case", SIZED)
def test_the_fast_reader_gives_up_on_each_value_the_exact_reader_must_judge(case, tmp_path):
    """launcher/sources/prompts_fast.py: with the model's size rule (multiples of 16, at most 1024x1024 pixels), the
    bounds of seeds and steps and those of ids, a batch holding a value the exact reader refuses or must name is
    given up whole; one whose values all fit is read by the fast reader itself, as the exact reader reads it."""
    from launcher.sources import prompts, prompts_fast
    from launcher.sources.prompts import SizeRule, Source, _GiveUp

    rows, gives_up = SIZED[case]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"p{k}", **r}) + "\n" for k, r in enumerate(rows)))
    ids = "id" if any("id" in r for r in rows) else None  # ids at most 200 bytes of UTF-8, none empty
    src = Source(str(f), sizes=SizeRule(16, 1024 * 1024, 64, 64), id_column=ids)
    if gives_up:
        with pytest.raises(_GiveUp):
            list(prompts_fast.fast_batches(str(f), src, 10))
        return
    fast = [
        {k: v for k, v in r.items() if v is not None}
        for b in prompts_fast.fast_batches(str(f), src, 10)
        for r in b.to_pylist()
    ]
    assert fast == [{k: v for k, v in r.items() if v is not None} for r in prompts._exact_rows(str(f), src, 10)]
    assert [r["prompt"] for r in fast] == [f"p{k}" for k in range(len(rows))]


def test_each_changed_shard_names_its_first_five_changed_ids_once_each():
    """launcher/ids/idresolve.py _name: for the refusal and kept_ids, each shard keeps up to five changed ids, the
    first of its rows in order, an id twice counted once, added to what that shard named already."""
    import numpy as np
    import pyarrow as pa

    from launcher.ids.idresolve import _name

    shards = np.array([2, 0, 2, 2, 0, 2, 2, 2, 2, 1, 0])
    ids = pa.array(["x", "p", "x", "a", "q", "b", "c", "d", "e", "z", "r"])
    changed = {0: ["o1", "o2", "o3", "o4"], 1: [], 2: []}
    _name(changed, shards, ids)
    # shard 2's first five rows are x, x, a, b, c: four ids; shard 0 had four and takes one more
    assert changed == {0: ["o1", "o2", "o3", "o4", "p"], 1: ["z"], 2: ["x", "a", "b", "c"]}
    full = {0: ["o1", "o2", "o3", "o4", "o5"], 1: [], 2: []}
    _name(full, shards, ids)
    assert full[0] == ["o1", "o2", "o3", "o4", "o5"]
    _name(full, np.array([], np.int64), pa.array([], pa.string()))  # nothing changed: nothing named


def test_the_fast_reader_reads_lines_up_to_the_line_bound_and_gives_up_past_it(tmp_path, monkeypatch):
    """launcher/sources/prompts_fast.py: a .txt line is read at most LINE_BYTES characters at a time (a longer one
    is never held whole): lines within the bound are read by the fast reader itself, as the exact reader reads them;
    a longer one makes it give up (the exact reader names its line) rather than split it."""
    from launcher.sources import prompts, prompts_fast, prompts_raw
    from launcher.sources.prompts import Source, _GiveUp

    for module in (prompts_fast, prompts_raw):
        monkeypatch.setattr(module, "LINE_BYTES", 20)
    f = tmp_path / "p.txt"
    f.write_text("a" * 19 + "\nbb\n")
    fast = [r["prompt"] for b in prompts_fast.fast_batches(str(f), Source(str(f)), 0) for r in b.to_pylist()]
    assert fast == [r["prompt"] for r in prompts._exact_rows(str(f), Source(str(f)), 0)] == ["a" * 19, "bb"]
    f.write_text("c" * 25 + "\nbb\n")
    with pytest.raises(_GiveUp):
        list(prompts_fast.fast_batches(str(f), Source(str(f)), 0))


def test_an_old_maps_rows_are_found_by_id_once_each():
    """launcher/ids/idplan.py: each id read now is found in its file's old map by its hash and its name; one
    read twice is found once (the second is a duplicate), one matched before is not found again, and an id the
    map lacks, or one whose hash another id has, is not found."""
    import numpy as np
    import pyarrow as pa

    from launcher.ids.idplan import _Own

    table = pa.table({"id": ["x", "y", "z"], "h": pa.array([30, 10, 20], pa.uint64()), "fp": [1, 2, 3],
                      "shard": [0, 0, 1], "pos": [0, 1, 0]})  # fmt: skip
    own = _Own(table)
    h = lambda *v: np.array(v, np.uint64)  # noqa: E731
    found = own.find(pa.array(["y", "q", "x", "y", "w"]), h(10, 99, 30, 10, 20))  # w: z's hash, another name
    assert found.tolist() == [1, -1, 0, -1, -1]
    assert own.find(pa.array(["z", "z"]), h(20, 20)).tolist() == [2, -1]
    own.matched[2] = True
    assert own.find(pa.array(["z"]), h(20)).tolist() == [-1]
    assert own.find(pa.array(["big"]), h(2**64 - 1)).tolist() == [-1]  # past the largest hash
    assert _Own(table.slice(0, 0)).find(pa.array(["x"]), h(30)).tolist() == [-1]
    assert own.unmatched().column_names == ["id", "h", "fp", "shard", "pos"]
    assert own.unmatched()["id"].to_pylist() == ["x", "y"]


@pytest.mark.parametrize("where", ["disk", "s3", "gs"])
def test_a_shards_image_folder_is_replaced_whole(where, tmp_path, request, monkeypatch):
    """Store.put_folder: the folder holds exactly the files given, an earlier attempt's extra files gone; on disk
    no temporary folder is left beside it, even where a write fails (a full disk) and the old folder stays; on an
    object store the other folders' files stay."""
    import os

    from launcher.ledger.store import Store

    if where != "disk":
        request.getfixturevalue({"s3": "s3", "gs": "gcs"}[where])  # the local S3 or GCS server
    store = Store(str(tmp_path) if where == "disk" else f"{where}://meshgen-test/{tmp_path.name}")
    store.write_bytes("images/shard-00004/keep.png", b"4")

    def held(rel):
        return {f.base_name: store.read_bytes(f"{rel}/{f.base_name}") for f in store.files(rel)}

    store.put_folder("images/shard-00003", {"a.png": b"1", "b.png": b"22"})
    assert held("images/shard-00003") == {"a.png": b"1", "b.png": b"22"}
    store.put_folder("images/shard-00003", {"b.png": b"333", "c.png": b""})
    assert held("images/shard-00003") == {"b.png": b"333", "c.png": b""}
    assert held("images/shard-00004") == {"keep.png": b"4"}
    if where == "disk":
        assert sorted(p.name for p in (tmp_path / "images").iterdir()) == ["shard-00003", "shard-00004"]
        real = os.fsync
        monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        with pytest.raises(OSError, match="No space left"):
            store.put_folder("images/shard-00003", {"d.png": b"5"})
        monkeypatch.setattr(os, "fsync", real)
        assert sorted(p.name for p in (tmp_path / "images").iterdir()) == ["shard-00003", "shard-00004"]
        assert held("images/shard-00003") == {"b.png": b"333", "c.png": b""}


def test_the_ledger_reads_each_changed_state_once_and_warns_once_per_damaged_file(tmp_path, caplog):
    """launcher/ledger/states.py: a refresh lists state/ once and reads only the state files that changed since;
    a damaged one counts as not done, with one warning naming it until it changes; a removed one is forgotten;
    names that are not shard-NNNNN.json are not states; the traceback stays in the file."""
    import logging
    import os

    from launcher.ledger.states import Ledger
    from launcher.ledger.store import Store

    state = tmp_path / "state"
    state.mkdir()
    good = {"status": "failed", "error": "boom", "traceback": "long", "rows": 2}
    (state / "shard-00000.json").write_text(json.dumps(good))
    (state / "shard-00001.json").write_text("{cut")
    (state / "shard-1.json").write_text(json.dumps(good))  # not a name a run writes
    (state / "notes.json").write_text("{}")
    ledger = Ledger(Store(tmp_path))
    with caplog.at_level(logging.WARNING, logger="launcher.ledger.states"):
        assert ledger.refresh() == {0: {"status": "failed", "error": "boom", "rows": 2}}
        assert ledger.reads == 2 and set(ledger.damaged) == {1} and ledger.damaged[1].startswith("not JSON")
        assert ledger.refresh() == {0: {"status": "failed", "error": "boom", "rows": 2}}
        assert ledger.reads == 2  # nothing changed: nothing read
        (state / "shard-00001.json").write_text("[]")  # damaged otherwise
        ledger.refresh()
        assert ledger.reads == 3 and ledger.damaged == {1: "a JSON list, not an object"}
        ledger.refresh()
    warned = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(warned) == 2 and all("shard-00001.json is damaged" in w for w in warned)
    assert "shard 1 counts as not done: a run generates it again" in warned[0]
    done = {"status": "done", "rows": 1, "prompts_fingerprint": "f"}
    (state / "shard-00001.json").write_text(json.dumps(done))
    os.utime(state / "shard-00001.json", ns=(1, 1))  # another mtime for sure
    assert ledger.refresh() == {0: {"status": "failed", "error": "boom", "rows": 2}, 1: done}
    assert ledger.damaged == {}
    (state / "shard-00000.json").unlink()
    assert ledger.refresh() == {1: done}
    (state / "shard-00002.json").write_text("{cut")  # damaged, then removed: forgotten as well
    ledger.refresh()
    assert set(ledger.damaged) == {2}
    (state / "shard-00002.json").unlink()
    assert ledger.refresh() == {1: done} and ledger.damaged == {}


def test_a_stranger_folder_is_refused_naming_three_of_its_entries_and_how_many_more(tmp_path):
    """launcher/ledger/runs.py check_ours: a non-empty folder without run.json is refused naming up to three of
    its entries and how many more; a folder that does not exist yet, or holds only empty folders, is fine."""
    from launcher.errors import ConfigError
    from launcher.ledger.runs import check_ours, without_weights
    from launcher.ledger.store import Store

    check_ours(Store(tmp_path / "new"))  # not there yet
    (tmp_path / "empty" / "state").mkdir(parents=True)
    check_ours(Store(tmp_path / "empty"))
    out = tmp_path / "theirs"
    out.mkdir()
    for name in ("c.txt", "a.txt", "b.txt"):
        (out / name).write_text("x")
    said = "output.dir {} is not empty and is not a meshgen folder (no run.json; it holds {}); choose an empty or "
    said += "new folder"
    with pytest.raises(ConfigError) as e:
        check_ours(Store(out))
    assert str(e.value) == said.format(out, "a.txt, b.txt, c.txt")
    (out / "d.txt").write_text("x")
    with pytest.raises(ConfigError) as e:
        check_ours(Store(out))
    assert str(e.value) == said.format(out, "a.txt, b.txt, c.txt and 1 more")

    # settings compared where one side does not know the weights: the model's other keys still count
    assert without_weights({"model": {"path": "m", "weights": "sha256 1"}, "seed": 0}) == {
        "model": {"path": "m"},
        "seed": 0,
    }
    assert without_weights({"model": {"weights": "sha256 1"}, "seed": 0}) == {"seed": 0}
    assert without_weights({"seed": 0}) == {"seed": 0}


def test_dead_claims_go_and_a_folder_without_claims_or_a_strangers_file_are_left_alone(tmp_path):
    """launcher/ledger/claims.py forget_dead: a folder with no claims/ yet is fine; a claim cut short (its writer died
    mid-write) or of a run holding no lock is deleted; what is not a claim (.json) stays, and so does its folder."""
    from launcher.ledger.claims import forget_dead
    from launcher.ledger.store import Store

    store = Store(tmp_path)
    forget_dead(store)  # no claims/ at all
    assert not (tmp_path / "claims").exists()
    store.write_bytes("claims/shard-00001/g00000.json", b'{"worker": 0, "ru')
    store.write_bytes("claims/shard-00002/g00000.json", b'{"worker": 0, "run_id": "gone"}')
    store.write_bytes("claims/shard-00002/notes.txt", b"mine")
    store.write_bytes("claims/README.json", b'{"a stranger": "at the top"}')  # a file, not a shard's folder
    forget_dead(store)
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "claims").rglob("*")) == [
        "claims/README.json",
        "claims/shard-00002",
        "claims/shard-00002/notes.txt",
    ]


def test_attempts_count_failures_alike_in_a_row_and_the_attempt_that_finally_worked():
    """launcher/ledger/states.py attempts_of: a shard's attempts in a row that ended as this one did: the first, or
    one after a done state, is 1; a failure with the error class of the failure before adds one to its count (a
    state from before counts were kept counts as 1); another error class starts again at 1; a success after failures
    counts them all, itself included."""
    from launcher.ledger.states import attempts_of

    failed = {"status": "failed", "error_class": "OutOfMemoryError", "attempts": 2}
    assert attempts_of(None, {"status": "failed", "error_class": "OutOfMemoryError"}) == 1
    assert attempts_of({"status": "done", "attempts": 3}, {"status": "failed", "error_class": "X"}) == 1
    assert attempts_of(failed, {"status": "failed", "error_class": "OutOfMemoryError"}) == 3
    assert attempts_of({**failed, "attempts": None}, {"status": "failed", "error_class": "OutOfMemoryError"}) == 2
    assert attempts_of({"status": "failed", "error_class": "X"}, {"status": "failed", "error_class": "X"}) == 2
    assert attempts_of(failed, {"status": "failed", "error_class": "ValueError"}) == 1
    assert attempts_of(failed, {"status": "done", "rows": 8}) == 3


def test_the_ledger_keeps_a_done_states_files_in_index_form_and_no_traceback(tmp_path):
    """launcher/ledger/states.py _slim: what the ledger holds of a state: its fields less the traceback, and its
    files as the index keeps them (an image folder as its count and bytes, each other file as its size)."""
    from launcher.ledger.states import Ledger, state_rel
    from launcher.ledger.store import Store

    store = Store(tmp_path)
    files = {"data/shard-00000.parquet": [10, "a" * 64], "images/shard-00000/x.png": [3, "b" * 64]}
    files["images/shard-00000/y.png"] = [4, "c" * 64]
    store.write_json(state_rel(0), {"status": "done", "rows": 2, "files": files, "traceback": "t"})
    store.write_json(state_rel(1), {"status": "failed", "error": "e", "traceback": "long"})
    assert Ledger(store).refresh() == {
        0: {"status": "done", "rows": 2, "files": {"data/shard-00000.parquet": [10], "images/shard-00000/": [2, 7]}},
        1: {"status": "failed", "error": "e"},
    }


def test_a_rows_references_are_hashed_located_and_counted(tmp_path):
    """launcher/sources/references.py plan_row: a row's references (a path, relative to the source's folder, a list
    of them, or images stored in the row) are each hashed (sha256 of their bytes) and located for lineage; the
    first one's size is the row's; none, too many, or an entry that is no image or path is refused naming it."""
    from launcher.errors import ConfigError
    from launcher.sources.prompts import SizeRule, Source
    from launcher.sources.references import plan_row, stored_name

    src = Source("d.jsonl", image_column="ref", sizes=SizeRule(16, 1 << 20, 512, 512, max_references=2))
    at, f = "dataset d.jsonl, line 2", str(tmp_path / "d.jsonl")
    a, b = _png(tmp_path / "a.png", 64, 96), _png(tmp_path / "b.png", 128, 64)
    assert plan_row(at, f, 1, "a.png", str(tmp_path), src) == (
        [hashlib.sha256(a).hexdigest()],
        [{"path": str(tmp_path / "a.png"), "src": str(tmp_path / "a.png")}],
        (64, 96),
    )
    shas, locs, size = plan_row(at, f, 1, ["b.png", {"path": "a.png"}], str(tmp_path), src)
    assert shas == [hashlib.sha256(b).hexdigest(), hashlib.sha256(a).hexdigest()] and size == (128, 64)
    assert [x["path"] for x in locs] == [str(tmp_path / "b.png"), str(tmp_path / "a.png")]
    shas, locs, size = plan_row(at, f, 4, [None, {"bytes": a, "path": "x.png"}, {"bytes": b}], str(tmp_path), src)
    assert shas == [hashlib.sha256(a).hexdigest(), hashlib.sha256(b).hexdigest()] and size == (64, 96)
    assert locs == [{"path": stored_name(f, 4, 0), "src": [f, "ref", 4, 0]},
                    {"path": stored_name(f, 4, 1), "src": [f, "ref", 4, 1]}]  # fmt: skip
    assert stored_name(f, 4, 0) == f"{f}#row=4" and stored_name(f, 4, 1) == f"{f}#row=4&ref=1"

    def refusal(value):
        with pytest.raises(ConfigError) as e:
            plan_row(at, f, 1, value, str(tmp_path), src)
        return str(e.value)

    assert refusal(None) == f"{at}: no reference image in column 'ref'; give one or drop the row"
    assert refusal([None]) == f"{at}: no reference image in column 'ref'; give one or drop the row"
    assert refusal(["a.png"] * 3) == (
        f"{at}: 3 reference images, more than the 2 this model family takes; give at most 2"
    )
    assert refusal(["a.png", 5]) == f"{at}: reference #1 is 5, not an image struct or a path; fix that row"
    assert refusal([{"path": ""}]) == f"{at}: reference #0 is '', not an image struct or a path; fix that row"


def test_late_rejections_are_marked_on_the_rows_of_their_positions():
    """launcher/sources/rejected.py marked: a batch whose first row is source position `at` gets its `rejected`
    column (null where a row is fine), and each late rejection (a duplicate id found once every row was read) is
    set on the row at its position, saying where and why; rejections of other batches' rows are not."""
    import pyarrow as pa

    from launcher.sources import rejected

    b = pa.RecordBatch.from_pydict({"id": ["a", "b", "c"], "prompt": ["x", "y", "z"]})
    out = rejected.marked(b, 10, ((9, "before"), (11, "dup of a"), (13, "after")))
    assert out.schema.field("rejected") == rejected.FIELD and out.column_names == ["id", "prompt", "rejected"]
    marks = out.column("rejected").to_pylist()
    assert marks[0] is None and marks[2] is None
    assert json.loads(marks[1]) == {"where": "row 11 of the source", "reason": "dup of a"}
    plain = rejected.marked(b, 10, ((13, "after"),))
    assert plain.column("rejected").null_count == 3  # none of its rows
    already = b.append_column(rejected.FIELD, pa.array(['{"where": "w", "reason": "r"}', None, None]))
    again = rejected.marked(already, 0, ((2, "late"),)).column("rejected").to_pylist()
    assert again[0] == '{"where": "w", "reason": "r"}' and again[1] is None
    assert json.loads(again[2]) == {"where": "row 2 of the source", "reason": "late"}
    assert rejected.marked(already, 0, ()).column_names == ["id", "prompt", "rejected"]


@pytest.mark.parametrize(
    "key, value, taken",
    [
        ("seed", 0, 0),
        ("seed", 2**63 - 1, 2**63 - 1),
        ("seed", "17", 17),  # a CSV cell is text
        ("seed", 3.0, 3),
        ("seed", -1, None),
        ("seed", 2**63, None),
        ("seed", 2.5, None),
        ("seed", True, None),
        ("seed", "x", None),
        ("height", 1, 1),
        ("height", 0, None),
        ("width", "64", 64),
        ("num_inference_steps", 1, 1),
        ("num_inference_steps", 1000, 1000),
        ("num_inference_steps", 1001, None),
        ("num_inference_steps", 0, None),
        ("guidance_scale", 0, 0.0),
        ("guidance_scale", "100", 100.0),
        ("guidance_scale", 100.5, None),
        ("guidance_scale", float("nan"), None),
        ("guidance_scale", [1], None),
        ("negative_prompt", "blurry", "blurry"),
        ("negative_prompt", 5, None),
    ],
)
def test_a_rows_own_setting_is_taken_within_the_configs_bounds_or_refused_naming_it(key, value, taken):
    """DESIGN: every value bounded; a row's seed, size, steps, guidance and negative prompt are taken as the
    pipeline needs them, or refused naming the row, the column, the value and what it must be."""
    from launcher.errors import ConfigError
    from launcher.sources.prompts_exact import _NEEDS, _override

    at = "dataset d.csv, line 9"
    if taken is not None:
        got = _override(at, key, value)
        assert got == taken and type(got) is type(taken)
        return
    with pytest.raises(ConfigError) as e:
        _override(at, key, value)
    need = _NEEDS.get(key, "an integer of 1 or more")
    assert str(e.value) == f"{at}: column {key!r} is {value!r}; it must be {need} (or empty, to use the config's)"
    assert need == {
        "seed": "an integer from 0 to 2**63-1",
        "num_inference_steps": "an integer from 1 to 1000",
        "guidance_scale": "a finite number from 0 to 100",
        "negative_prompt": "text",
    }.get(key, "an integer of 1 or more")


# A written row's fields as the worker hands them to the writer (launcher/writer/stream.py), less its id and image.
_ROW = {"prompt": "p", "seed": 7, "height": 32, "width": 48, "num_inference_steps": 2, "guidance_scale": 1.5,
        "negative_prompt": "", "model": "m"}  # fmt: skip


def _write_shard(store, samples: list[dict], *overrides: str) -> None:
    """shard-00000 of `samples` (each its id, its image's `encoded` bytes and what differs from _ROW), written
    through ShardStream with conf tiny's output settings and `overrides`."""
    from launcher.config import load_config
    from launcher.writer.stream import ShardStream

    stream = ShardStream(store, "shard-00000", load_config("tiny", list(overrides)).output)
    stream.add([_ROW | s for s in samples])
    stream.commit()


def test_a_webdataset_shard_holds_each_samples_image_and_json_in_order_with_fixed_metadata(tmp_path):
    """launcher/writer/stream.py: `<key>.<ext>` and `<key>.json` per sample, in order, keys from the sample ids
    as file names, mode 644 and time 0 so that the same samples give the same bytes; the JSON holds the row's
    columns but the image."""
    import tarfile

    from launcher.ledger.store import Store

    def sample(i, pid):
        return {"id": i, "prompt_id": pid, "prompt": f"p {i}", "image": {"bytes": b"x", "path": None},
                "encoded": f"png-{i}".encode()}  # fmt: skip

    def webdataset_tar(folder) -> bytes:
        _write_shard(Store(folder), [sample("a-1", "a"), sample("a/0", "a")], "output.webdataset=true")
        return (folder / "webdataset" / "shard-00000.tar").read_bytes()

    data = webdataset_tar(tmp_path / "one")
    assert data == webdataset_tar(tmp_path / "two")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == ["a-1.png", "a-1.json", "a_0.png", "a_0.json"]
        assert {(m.mode, m.mtime) for m in members} == {(0o644, 0)}
        assert tar.extractfile("a_0.png").read() == b"png-a/0"
        meta = json.loads(tar.extractfile("a-1.json").read())
    assert meta == {"id": "a-1", "prompt_id": "a", "prompt": "p a-1", "seed": 7, "height": 32, "width": 48,
                    "num_inference_steps": 2, "guidance_scale": 1.5, "negative_prompt": "", "model": "m"}  # fmt: skip


def test_a_webdataset_json_carries_kept_timestamp_date_and_decimal_columns_as_text(tmp_path):
    """DESIGN: kept source columns are carried into every output; JSON has no timestamp, date or decimal type, so
    a WebDataset sample's JSON holds them as text (the Parquet keeps their types)."""
    import datetime
    import decimal
    import tarfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    from launcher.ledger.store import Store
    from launcher.writer.writer import KEPT_FIELDS

    kept = (pa.field("taken", pa.timestamp("us")), pa.field("day", pa.date32()), pa.field("price", pa.decimal128(5, 2)))
    values = {"taken": datetime.datetime(2026, 1, 2, 3, 4, 5), "day": datetime.date(2026, 1, 2)}
    sample = {"id": "a", "encoded": b"png", "price": decimal.Decimal("1.50"), KEPT_FIELDS: kept} | values
    _write_shard(Store(tmp_path), [sample], "output.webdataset=true", "output.parquet=true")
    with tarfile.open(tmp_path / "webdataset" / "shard-00000.tar") as tar:
        meta = json.loads(tar.extractfile("a.json").read())
    assert (meta["taken"], meta["day"], meta["price"]) == ("2026-01-02 03:04:05", "2026-01-02", "1.50")
    row = pq.read_table(tmp_path / "data" / "shard-00000.parquet").to_pylist()[0]
    assert {k: row[k] for k in ("taken", "day", "price")} == {**values, "price": decimal.Decimal("1.50")}


def test_image_files_in_a_bucket_are_the_shards_samples_and_an_earlier_attempts_other_files_go(s3, tmp_path):
    """DESIGN: `output.image_files=true` writes `images/<shard>/<sample id>.png`; in a bucket each file is written
    in place, so at the end the shard's image folder holds its samples' files and no other (an earlier attempt's
    file of a sample no longer in the shard goes)."""
    from launcher.ledger.store import Store

    store = Store(f"s3://meshgen-test/{tmp_path.name}")
    store.write_bytes("images/shard-00000/gone.png", b"an earlier attempt's")
    _write_shard(store, [{"id": i, "encoded": f"png-{i}".encode()} for i in ("a", "b")], "output.image_files=true")
    assert sorted(i.base_name for i in store.files("images/shard-00000")) == ["a.png", "b.png"]
    assert store.read_bytes("images/shard-00000/b.png") == b"png-b"


def test_the_tiny_model_is_built_on_first_use_at_its_own_location_and_nowhere_else(tmp_path, monkeypatch):
    """conf/model/tiny_flux2.yaml: the project's tiny model is built on first use, at `models/tiny-flux2` of the
    checkout only; a missing path elsewhere is exit 2, and nothing is built there."""
    import launcher.config
    from launcher.checks.prepare import fetch_model
    from launcher.config import load_config
    from launcher.errors import ConfigError

    monkeypatch.setattr(launcher.config, "REPO_ROOT", tmp_path)  # the checkout, as default_dir sees it
    elsewhere, own = tmp_path / "elsewhere", tmp_path / "models" / "tiny-flux2"
    with pytest.raises(ConfigError, match=f"built on first use only at its own location {own};"):
        fetch_model(load_config("tiny", [f"model.path={elsewhere}"]))
    assert not elsewhere.exists()
    fetch_model(load_config("tiny", [f"model.path={own}"]))
    assert json.loads((own / "model_index.json").read_text())["_class_name"] == "Flux2Pipeline"


def test_a_pipeline_class_diffusers_lacks_or_none_has_no_lora_loader():
    """launcher/worker/lora.py loader_class: a custom pipeline's class (not in diffusers) or a model_index.json
    without one ("") has no LoRA loader: the preflight's one-line refusal rests on it (not an AttributeError)."""
    from launcher.worker.lora import loader_class

    assert loader_class("MyOwnCustomPipeline") is None and loader_class("") is None
    assert loader_class("PixArtAlphaPipeline") is None  # in diffusers, without a LoRA loader
    assert loader_class("Flux2Pipeline").__name__ == "Flux2Pipeline"


def test_hosts_that_differ_are_refused_on_every_host_with_the_same_line(monkeypatch):
    """DESIGN: every host of a job computes its settings; the hosts compare before any generates, and a mismatch
    is exit 2 on every host naming the keys that differ (here through a real TCPStore on loopback, as the
    launchers' own). A key only one host has reads (none); long values are cut; at most eight are named."""
    import threading

    from torch.distributed import TCPStore

    from launcher.errors import ConfigError
    from launcher.host import agreement

    monkeypatch.setattr(agreement, "READ_FOR_S", 30.0)
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    first = {"generate.seed": 1, "model.weights.transformer": "a" * 64, "mesh.tp": 2}
    other = {"generate.seed": 2, "model.weights.transformer": "b" * 64, "mesh.tp": 2, "versions.torch": "2.13"}
    errors = {}

    def host(node: int, job: dict) -> None:
        try:
            agreement.agree(server, node, 2, job)
        except ConfigError as e:
            errors[node] = str(e)

    one = threading.Thread(target=host, args=(1, other))
    one.start()
    host(0, first)
    one.join(timeout=60)
    assert not one.is_alive()
    line = (
        f"host 1's settings differ from host 0's: generate.seed 2 != 1, model.weights.transformer "
        f"{'b' * 12}... != {'a' * 12}..., versions.torch 2.13 != (none); start every host with the same job"
    )
    assert errors == {0: line, 1: line}
    errors.clear()
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    one = threading.Thread(target=host, args=(1, dict(first)))
    one.start()
    host(0, first)  # the same job: both go on
    one.join(timeout=60)
    assert errors == {}
    many = {f"k{i}": i for i in range(10)}
    assert agreement.differences({}, many) == ", ".join(f"k{i} (none) != {i}" for i in range(8)) + " and 2 more"
    assert agreement.differences(many, dict(many)) == ""


def _stream_sample(i: int) -> dict:
    row = {"id": f"s{i}", "prompt": f"p{i}", "seed": i, "height": 8, "width": 8, "num_inference_steps": 2}
    return {
        **row,
        "guidance_scale": 1.0,
        "negative_prompt": "",
        "model": "m",
        "encoded": f"img-{i}".encode(),
        "_pos": i,
    }


def test_a_shard_streamed_out_of_order_is_written_in_order_in_row_groups_and_committed_whole(tmp_path):
    """launcher/writer/stream.py: samples that arrive before their turn wait; the Parquet holds the shard's rows in
    order in row groups of output.row_group_size; image files and the WebDataset tar beside it; nothing appears
    before commit, and commit's record is each file's size and sha256."""
    import tarfile
    import types

    import pyarrow.parquet as pq

    from launcher.ledger.store import Store
    from launcher.writer.stream import ShardStream

    cfg = types.SimpleNamespace(format="png", parquet=True, webdataset=True, image_files=True, row_group_size=2)
    stream = ShardStream(Store(tmp_path), "shard-00004", cfg)
    for batch in ([3, 0], [4], [1, 2]):
        stream.add([_stream_sample(i) for i in batch])
    assert not (tmp_path / "data" / "shard-00004.parquet").exists()  # not before commit
    record = stream.commit()
    assert stream.images == 5
    data = tmp_path / "data" / "shard-00004.parquet"
    pf = pq.ParquetFile(data)
    assert [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)] == [2, 2, 1]
    rows = pf.read().to_pylist()
    assert [r["id"] for r in rows] == ["s0", "s1", "s2", "s3", "s4"]
    assert rows[3]["image"] == {"bytes": b"img-3", "path": "s3.png"} and rows[3]["seed"] == 3
    images = sorted(p.name for p in (tmp_path / "images" / "shard-00004").iterdir())
    assert images == [f"s{i}.png" for i in range(5)]
    with tarfile.open(tmp_path / "webdataset" / "shard-00004.tar") as tar:
        assert [m.name for m in tar.getmembers()][:4] == ["s0.png", "s0.json", "s1.png", "s1.json"]
    on_disk = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    assert set(record["files"]) == on_disk
    for rel, (size, sha) in record["files"].items():
        body = (tmp_path / rel).read_bytes()
        assert (size, sha) == (len(body), hashlib.sha256(body).hexdigest()), rel
    assert 0 < record["data_bytes"]


def test_an_aborted_shard_leaves_nothing_and_an_empty_one_still_has_its_files(tmp_path):
    import types

    import pyarrow.parquet as pq

    from launcher.ledger.store import Store
    from launcher.writer.stream import ShardStream

    cfg = types.SimpleNamespace(format="png", parquet=True, webdataset=True, image_files=True, row_group_size=2)
    stream = ShardStream(Store(tmp_path), "shard-00001", cfg)
    stream.add([_stream_sample(i) for i in (1, 0, 2)])
    stream.abort()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    embedded = types.SimpleNamespace(**{**vars(cfg), "image_files": False, "webdataset": False, "embed_images": False})
    record = ShardStream(Store(tmp_path), "shard-00002", embedded).commit()
    assert list(record["files"]) == ["data/shard-00002.parquet"]
    assert pq.read_table(tmp_path / "data" / "shard-00002.parquet").num_rows == 0
    stream = ShardStream(Store(tmp_path), "shard-00003", embedded)
    stream.add([_stream_sample(0)])
    stream.commit()
    row = pq.read_table(tmp_path / "data" / "shard-00003.parquet").to_pylist()[0]
    assert row["image"] == {"bytes": None, "path": "images/shard-00003/s0.png"}  # a row that points at its file


def test_a_run_the_output_stopped_ends_with_one_line_saying_why(tmp_path, monkeypatch):
    """launcher/sizing/space.py: out of space (a worker said so, the launcher failed, or less room than one shard
    needs), out of inodes, or a folder that refuses writes: the run's last line says which and how to go on; a run
    with room that nothing stopped says nothing. The output's own numbers are this seam's (statvfs, a probe)."""
    import errno

    from launcher.config import load_config
    from launcher.ledger.store import Store
    from launcher.sizing import space

    cfg = load_config("tiny", ["generate.height=64", "generate.width=64", "run.shard_size=4"])
    store = Store(tmp_path)
    need = space.estimate_bytes(cfg, 4)
    free = {"bytes": 10 * 2**30, "inodes": 1000, "probe": None}
    monkeypatch.setattr(space, "free_bytes", lambda s: free["bytes"])
    monkeypatch.setattr(space, "free_inodes", lambda s: free["inodes"])
    monkeypatch.setattr(space, "probe_write", lambda s: free["probe"])
    mine, other = {0: {"run_id": "r", "out_of_space": True}}, {0: {"run_id": "old", "out_of_space": True}}
    assert space.stopped_by_space(cfg, store, {}, "r", False) is None
    assert space.stopped_by_space(cfg, store, other, "r", False) is None  # an earlier run's word
    out = f"error: {store} is out of space (10.0 GB free); free some space and run the same command again to finish"
    assert space.stopped_by_space(cfg, store, mine, "r", False) == out
    assert space.stopped_by_space(cfg, store, {}, "r", True) == out
    free["bytes"] = need - 1  # less than one shard
    assert space.stopped_by_space(cfg, store, {}, "r", False).startswith(f"error: {store} is out of space (")
    free["bytes"] = need
    assert space.stopped_by_space(cfg, store, {}, "r", False) is None
    free["inodes"] = 0
    assert space.stopped_by_space(cfg, store, mine, "r", False) == (
        f"error: {store} is out of inodes (0 free, {space.size_text(need)} of space free); remove files (or move the "
        "output to a file system with more inodes, or use output.image_files=false) and run the same command again"
    )
    free["probe"] = OSError(errno.EROFS, "Read-only file system")
    assert space.stopped_by_space(cfg, store, {}, "r", False) == (
        f"error: {store} refuses writes ([Errno 30] Read-only file system); make it writable again and run the "
        "same command to finish"
    )
    assert [space.size_text(n) for n in (0, 1023, 1024, 1536 * 1024, 5 * 2**40)] == [
        "0 B", "1023 B", "1.0 KB", "1.5 MB", "5.0 TB"]  # fmt: skip


def test_the_card_vouches_only_for_done_shards_and_counts_them(tmp_path):
    """DESIGN: the dataset card (README.md) says what the folder holds: shards done, failed and pending and their
    images, the done shards' Parquet files only (by name when another file lies there, by glob when every file is
    a done shard's), their rows and sizes, the license in the Hub's terms, and the load line."""
    import types

    import yaml

    from launcher.config import load_config
    from launcher.ledger.runs import write_run_json
    from launcher.ledger.states import state_rel
    from launcher.ledger.store import Store
    from launcher.publish import card
    from launcher.writer.stream import ShardStream

    store = Store(tmp_path)
    cfg = load_config("tiny", ["model.path=org/tiny", "model.build=null", "run.shard_size=2", "model.license=MIT"])
    write_run_json(store, cfg, 4)
    out = types.SimpleNamespace(format="png", parquet=True, webdataset=False, image_files=False, row_group_size=2)
    states = {}
    for shard, ids in ((0, [0, 1]), (2, [4]), (3, [6, 7])):  # shard 3's file is an attempt never marked done
        stream = ShardStream(store, f"shard-{shard:05d}", out)
        stream.add([{**_stream_sample(i), "_pos": k} for k, i in enumerate(ids)])
        record = stream.commit()
        if shard != 3:
            states[shard] = {"status": "done", "rows": len(ids), "seconds": 1.0, "run_id": "r", **record}
    states[1] = {"status": "failed", "error": "boom\ntraceback", "seconds": 0.5, "run_id": "r"}
    for i, st in states.items():
        store.write_json(state_rel(i), st)
    text = card.card_text(store, repo_id="org/set")
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["license"] == "mit" and front["task_categories"] == ["text-to-image"]
    assert front["configs"][0]["data_files"] == [
        {"split": "train", "path": ["data/shard-00000.parquet", "data/shard-00002.parquet"]}
    ]
    assert front["dataset_info"]["splits"] == [
        {"name": "train", "num_bytes": states[0]["data_bytes"] + states[2]["data_bytes"], "num_examples": 3}
    ]
    sizes = sum((tmp_path / "data" / f"shard-{i:05d}.parquet").stat().st_size for i in (0, 2))
    assert front["dataset_info"]["download_size"] == sizes and front["size_categories"] == ["n<1K"]
    assert "4 shards of 2 prompts: 2 done, 1 failed, 1 pending; 3 images." in text
    assert "This run is not complete: the card names only the done shards' data." in text
    assert 'ds = load_dataset("org/set", split="train")' in text
    (tmp_path / "data" / "shard-00003.parquet").unlink()
    store.write_json(state_rel(1), {**states[0], "rows": 2})
    store.write_bytes("data/shard-00001.parquet", (tmp_path / "data" / "shard-00000.parquet").read_bytes())
    store.write_json(state_rel(3), {**states[0], "rows": 2})
    store.write_bytes("data/shard-00003.parquet", (tmp_path / "data" / "shard-00000.parquet").read_bytes())
    text = card.card_text(store)
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["configs"][0]["data_files"] == [{"split": "train", "path": "data/*.parquet"}]  # all done: a glob
    assert "not complete" not in text  # every shard done
    assert "- license: MIT" in text  # the model's own note, in the body as in the front matter
    assert 'ds = load_dataset("path/to/this/folder", split="train")' in text  # no repo: the folder's own line
    assert text.split("---\n")[1].splitlines()[0] == f"license: {front['license']}"  # the Hub's order, not sorted
    assert [card.size_category(n) for n in (999, 1000, 10**8, 10**9)] == ["n<1K", "1K<n<10K", "100M<n<1B", "1B<n<10B"]
    assert card.hub_license("Apache-2.0") == {"license": "apache-2.0"}
    link = "https://x.org/LICENSE.md"
    assert card.hub_license(f"FLUX.1 [dev] Non-Commercial License {link}") == {
        "license": "other", "license_name": "flux-1-dev-non-commercial-license", "license_link": link}  # fmt: skip
    assert card.hub_license("  ") == {}
    store.delete(state_rel(3))  # one shard pending and none failed: not complete either
    assert "This run is not complete: the card names only the done shards' data." in card.card_text(store)


def test_the_progress_bar_counts_this_runs_done_images_and_failed_shards(tmp_path):
    """launcher/host/summary.py Progress: the bar counts the images of this run's done shards (not an earlier
    run's), its failed shards in the postfix, hands this run's done shards to output.publish, and says
    "generating" once images flow."""
    from launcher.host.summary import Progress
    from launcher.ledger.states import Ledger, state_rel
    from launcher.ledger.store import Store

    store = Store(tmp_path)
    states = {0: {"status": "done", "rows": 4, "run_id": "old"}, 1: {"status": "done", "rows": 3, "run_id": "r"},
              2: {"status": "failed", "run_id": "r"}, 3: {"status": "done", "rows": 2, "run_id": "r"}}  # fmt: skip
    for i, st in states.items():
        store.write_json(state_rel(i), st)
    pushed = []
    progress = Progress(Ledger(store), 20, "r", on_done=pushed.append)
    assert progress._bar.desc == "starting workers"
    progress._update()
    assert progress._bar.n == 5 and progress._bar.postfix == "failed_shards=1"
    assert pushed == [[1, 3]] and progress._bar.desc == "generating"
    store.write_json(state_rel(2), {"status": "done", "rows": 4, "run_id": "r"})
    progress._update()
    assert progress._bar.n == 9 and progress._bar.postfix == "failed_shards=0" and pushed[-1] == [1, 2, 3]
    progress._bar.close()


def test_the_true_cfg_scales_a_run_calls_with_and_lora_scale_keys():
    """The true_cfg_scale values the pipeline is called with: the swept ones, else model.call_kwargs', else none;
    `lora_scale.<i>` names the i-th LoRA's scale only with i written plainly."""
    from launcher.plan.sweep import lora_index, true_cfg_scales

    cfg = lambda sweep=None, kw=None: OmegaConf.create({"generate": {"sweep": sweep}, "model": {"call_kwargs": kw}})  # noqa: E731
    assert true_cfg_scales(cfg()) == []
    assert true_cfg_scales(cfg(kw={"true_cfg_scale": 4})) == [4.0]
    assert true_cfg_scales(cfg(sweep={"true_cfg_scale": [1, 2.5]}, kw={"true_cfg_scale": 4})) == [1.0, 2.5]
    assert true_cfg_scales(cfg(sweep={"guidance_scale": [1]}, kw={"true_cfg_scale": 3})) == [3.0]
    assert [lora_index(k) for k in ("lora_scale.0", "lora_scale.12", "lora_scale.01", "lora_scale.", "scale.1")] == [
        0, 12, None, None, None]  # fmt: skip


def test_a_parquet_row_whose_text_is_not_utf8_is_a_bad_row_not_an_unreadable_file():
    """Parquet and Arrow do not guarantee UTF-8 text: a row holding other bytes in a text column is a bad row (named
    as such), its neighbours read as they are, large strings too, and nulls stay nulls."""
    import pyarrow as pa

    from launcher.sources.prompts_raw import rows_of
    from launcher.sources.row_checks import Bad

    raw = pa.array([b"ok", b"\xff\xfe", None], pa.binary())
    batch = pa.RecordBatch.from_arrays(
        [raw.view(pa.string()), raw.cast(pa.large_binary()).view(pa.large_string()), pa.array([1, 2, 3])],
        names=["prompt", "note", "n"],
    )
    rows = rows_of(batch)
    assert rows[0] == {"prompt": "ok", "note": "ok", "n": 1} and rows[2] == {"prompt": None, "note": None, "n": 3}
    assert isinstance(rows[1], Bad) and rows[1].reason == (
        "a text column holds bytes that are not UTF-8 (invalid start byte); rewrite that row as UTF-8"
    )
    good = pa.RecordBatch.from_pydict({"prompt": ["a", "b"]})
    assert rows_of(good) == [{"prompt": "a"}, {"prompt": "b"}]


def test_a_glob_lists_each_file_once_under_its_first_path_and_names_a_loop(tmp_path, monkeypatch, caplog):
    """DESIGN and globs.py: globs mean what Python's glob means, each file listed once under the first of its paths
    in sorted order (a symlink, a folder link, a hard link), relative globs stay relative, and a folder link back
    to a folder it is inside is refused naming the link, as `**` would never end."""
    import glob
    import logging
    import os

    from launcher.errors import ConfigError
    from launcher.sources.prompts import source_files

    g = tmp_path / "g"
    for f in ("top.txt", "a/one.txt", "c/two.txt", "a/.dot.txt", ".h/hidden.txt"):
        (g / f).parent.mkdir(parents=True, exist_ok=True)
        (g / f).write_text(f"a prompt from {f}\n")
    (g / "a" / "link.txt").symlink_to(g / "c" / "two.txt")
    (g / "e").symlink_to(g / "c")  # a second path to a folder: no loop
    os.link(g / "top.txt", g / "a" / "hard.txt")

    def first_paths(paths):  # the contract's words: each file once, under the first of its paths in sorted order
        seen = {}
        for p in sorted(paths):
            st = os.stat(p)
            seen.setdefault((st.st_dev, st.st_ino), p)
        return sorted(seen.values())

    want = first_paths(glob.glob(f"{g}/**/*.txt", recursive=True))
    assert want == [f"{g}/a/hard.txt", f"{g}/a/link.txt", f"{g}/a/one.txt"]  # the fixture reaches every kind
    with caplog.at_level(logging.INFO, logger="launcher.sources.globs"):
        assert source_files(f"{g}/**/*.txt") == want
    for pattern in ("*/two.txt", "*/.*.txt", ".*/*.txt", "[a-c]/*.txt"):  # a plain part after a glob; "." names
        assert source_files(f"{g}/{pattern}") == first_paths(glob.glob(f"{g}/{pattern}")), pattern
    assert source_files(f"{g}/*/two.txt") == [f"{g}/c/two.txt"]  # e/two.txt is the same file
    assert f"{g}/c/two.txt is {g}/a/link.txt under another name: read once" in caplog.text
    monkeypatch.chdir(g)
    assert source_files("*/*.txt") == first_paths(glob.glob("*/*.txt")) == ["a/hard.txt", "a/link.txt", "a/one.txt"]
    (g / "a" / "up").symlink_to("..")  # back to g
    with pytest.raises(ConfigError, match=f"dataset.path {g}/\\*\\*/\\*.txt: {g}/a/up leads back to {g}, a folder"):
        source_files(f"{g}/**/*.txt")
    with pytest.raises(ConfigError, match=f"{g}/a/up leads back to {g}"):  # a ** reached through a *
        source_files(f"{g}/*/**/*.txt")
    assert source_files(f"{g}/a/up/a/*.txt") == [f"{g}/a/up/a/hard.txt", f"{g}/a/up/a/link.txt", f"{g}/a/up/a/one.txt"]


def test_objects_of_one_size_time_and_etag_are_listed_once(store_env, caplog):
    """globs.py: on an object store (S3, GCS), two objects with one size, time and ETag are one file, listed under
    the first path; an object of the same size and time but other bytes is another file (its ETag, a HEAD request,
    differs)."""
    import logging

    import pyarrow.fs as pafs

    from launcher.ledger.store import Store
    from launcher.sources.globs import once_each

    scheme = f"{store_env[0]}://"
    store = Store(f"{scheme}meshgen-test/once")
    for name, data in (("a.txt", b"same"), ("b.txt", b"same"), ("c.txt", b"diff"), ("d.txt", b"other size")):
        store.write_bytes(name, data)
    found = [f"meshgen-test/once/{n}" for n in ("a.txt", "b.txt", "c.txt", "d.txt")]
    at = 1_700_000_000_000_000_000
    infos = {f: pafs.FileInfo(f, pafs.FileType.File, mtime_ns=at, size=4) for f in found[:3]}
    infos[found[3]] = pafs.FileInfo(found[3], pafs.FileType.File, mtime_ns=at, size=10)
    with caplog.at_level(logging.INFO, logger="launcher.sources.globs"):
        assert once_each(found, infos, store.fs, scheme) == [found[0], found[2], found[3]]
    assert f"dataset.path: {scheme}{found[1]} has the content of {scheme}{found[0]}: read once" in caplog.text
    assert once_each(found[:2], infos, store.fs, scheme) == found[:1]  # a pair alike
    # No listing's info: each object's is asked for. a and b were written within the same second or not (the
    # store's times have whole seconds): b is dropped exactly when they were.
    got, times = once_each(found, {}, store.fs, scheme), [store.fs.get_file_info(f).mtime for f in found[:2]]
    assert got == ([found[0], found[2], found[3]] if times[0] == times[1] else found)
    assert once_each(found, {**infos, found[1]: pafs.FileInfo(found[1], pafs.FileType.File, mtime_ns=at + 1, size=4)},
                     store.fs, scheme) == found  # fmt: skip


def test_bounds_at_their_edges_and_each_refusal_line_whole():
    """DESIGN: a prompt at most 64 KiB of UTF-8 (counted in bytes: 16,384 four-byte characters are exactly 64 KiB),
    steps 1..1000 and guidance finite in 0..100 by whatever path, and `model.call_kwargs` holding only plain values
    within the same bounds; each refusal is one whole line naming the key and the fix."""
    from launcher.sources.bounds import call_kwargs_problem, config_problems, number_problem, text_problem
    from launcher.sources.row_checks import id_problem, line_problem

    four = "\U0001f600"  # 4 bytes of UTF-8
    assert text_problem("p", four * 16384) is None and text_problem("p", "a" * 65536) is None
    assert text_problem("p", "a" * 65535 + "é") == (
        "p is 65537 bytes of UTF-8, more than the 65536 (64 KiB) a prompt may hold; shorten it: the text encoder "
        "reads only its first generate.max_sequence_length tokens anyway"
    )
    assert text_problem("p", four * 16385).startswith("p is 65540 bytes of UTF-8")
    assert number_problem("guidance_scale", 101) == "must be a finite number from 0 to 100"
    assert number_problem("true_cfg_scale", -1) == "must be a finite number from 0 to 100"
    assert number_problem("num_inference_steps", 1000) is None and number_problem("some_knob", 1e9) is None
    assert number_problem("some_knob", float("inf")) == "must be a finite number"  # a key of no bounds: finite
    g = type(
        "G", (), {"num_inference_steps": 0, "guidance_scale": 1.0, "max_sequence_length": 1, "images_per_prompt": 1}
    )
    assert config_problems(g) == ["generate.num_inference_steps=0 must be an integer from 1 to 1000"]
    g.num_inference_steps, g.guidance_scale, g.max_sequence_length, g.images_per_prompt = 1, 101.0, 0, 10_001
    assert config_problems(g) == [
        "generate.guidance_scale=101.0 must be a finite number from 0 to 100",
        "generate.max_sequence_length=0 must be an integer from 1 to 4096",
        "generate.images_per_prompt=10001 must be an integer from 1 to 10000",
    ]
    g.guidance_scale, g.max_sequence_length, g.images_per_prompt = 100.0, 4096, 10_000
    assert config_problems(g) == []

    assert call_kwargs_problem({"knob": [1, "x" * 65537]}) == (
        "model.call_kwargs.knob is 65537 bytes of UTF-8, more than the 65536 (64 KiB) a prompt may hold; shorten "
        "it: the text encoder reads only its first generate.max_sequence_length tokens anyway"
    )
    assert call_kwargs_problem({"true_cfg_scale": 1e3}) == (
        "model.call_kwargs.true_cfg_scale=1000.0 must be a finite number from 0 to 100"
    )
    assert call_kwargs_problem({"knob": "short", "n": 7, "on": True, "off": None, "many": [1, "two", False]}) is None
    assert call_kwargs_problem({"knob": {"a": 1}}) == (
        "model.call_kwargs.knob={'a': 1} is not a plain value; give text, a number, true/false or a list of those "
        "(the record must hold what the pipeline is called with)"
    )

    assert id_problem("a" * 200, "id") is None
    assert id_problem("a" * 201, "id") == (
        "the id ('id') is 201 bytes of UTF-8, more than the 200 a file name can take; use a shorter id (e.g. a hash "
        "of it)"
    )
    assert line_problem(10**6) == (
        "the line is longer than 1024 KiB (a prompt may hold 64 KiB); fix or remove that line"
    )


def test_liveness_edges_each_lock_watched_apart_and_the_pid_space_read_from_proc(tmp_path, monkeypatch):
    """liveness.py at its edges: bytes unchanged for exactly STALE_S of the watcher's clock are dead (a lock is
    dead once unchanged *for* stale_s), as is a first look whose age by the store's clock is exactly stale_s; each
    lock is remembered apart; a lock released and written again is looked at afresh; a lock gone between its read
    and its time is no holder; a record that is not an object is none; the pid space is this boot's and pid
    namespace's, read from /proc."""
    import os

    from launcher.ledger import liveness
    from launcher.ledger.store import Store

    boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    assert liveness._pid_space() == f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    assert liveness.pid_alive(os.getpid()) is True

    store, a, b = Store(tmp_path), "locks/worker-00000.json", "locks/worker-00001.json"
    clock = [1000.0]
    monkeypatch.setattr(liveness.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(liveness, "_seen", {})
    rec = {"host": "h", "pid": 12345, "run_id": "r", "beat": 1}
    for rel in (a, b):
        store.write_bytes(rel, json.dumps({**rec, "rel": rel}).encode())
    assert liveness.watch(store, a, 60)[1] and liveness.watch(store, b, 60)[1]
    clock[0] += 100
    assert liveness.watch(store, a, 60)[1] is False  # b's bytes are not a rewrite of a
    store.delete(a)
    assert liveness.watch(store, a, 60) == (None, False)
    store.write_bytes(a, json.dumps({**rec, "rel": a}).encode())  # the same bytes again, just written
    assert liveness.watch(store, a, 60)[1] is True

    store.write_bytes(a, json.dumps({**rec, "beat": 2}).encode())
    assert liveness.watch(store, a, 60)[1] is True  # rewritten: watched from this moment on
    clock[0] += 60
    assert liveness.watch(store, a, 60)[1] is False  # unchanged for exactly 60 s

    monkeypatch.setattr(liveness, "_seen", {})
    monkeypatch.setattr(store, "now", lambda: 5000.0)
    monkeypatch.setattr(store, "mtime", lambda rel: 5000.0 - 30)  # a first look: 30 s old by the store's clock
    assert liveness.watch(store, b, 60)[1] is True
    clock[0] += 31  # 61 s since it was written, by the watcher's clock from then on
    assert liveness.watch(store, b, 60)[1] is False
    monkeypatch.setattr(liveness, "_seen", {})
    monkeypatch.setattr(store, "mtime", lambda rel: 5000.0 - 60)
    assert liveness.watch(store, b, 60)[1] is False  # exactly 60 s old
    monkeypatch.setattr(liveness, "_seen", {})
    monkeypatch.setattr(store, "mtime", lambda rel: None)  # released between the read and its time
    assert liveness.watch(store, b, 60) == ({**rec, "rel": b}, False)
    store.write_bytes(b, b"[1, 2]")
    assert liveness.watch(store, b, 60) == (None, False)


def test_an_object_store_lock_beats_survives_an_error_and_stops_its_run_once_taken_over(s3, monkeypatch, caplog):
    """DESIGN: on an object store the lock is rewritten by its holder every HEARTBEAT_S; a holder that finds its
    lock taken over stops (SIGTERM to itself, as a stop would) and writes nothing more. A store error at one beat is
    a warning, and the next beat writes again."""
    import threading

    from launcher.ledger import lock as lock_mod
    from launcher.ledger.store import Store

    monkeypatch.setattr(lock_mod, "HEARTBEAT_S", 0.01)
    stopped = threading.Event()
    kills = []
    monkeypatch.setattr(lock_mod.os, "kill", lambda pid, sig: (kills.append((pid, sig)), stopped.set()))
    store = Store("s3://meshgen-test/beats")
    held = lock_mod.RunLock(store, 2, "run-a")
    held.acquire()
    try:
        assert json.loads(store.read_bytes("locks/worker-00002.json"))["run_id"] == "run-a"  # a JSON object
        _beats_then_stops(held, store, kills, stopped, monkeypatch, caplog)
    finally:  # a failed check leaves no heartbeat running behind the test
        held.release()


def _beats_then_stops(held, store, kills, stopped, monkeypatch, caplog) -> None:
    import os
    import signal
    import threading
    import time

    from launcher.ledger import lock as lock_mod

    def beat() -> int:
        return (lock_mod.read_lock(store, 2) or {}).get("beat", 0)

    def wait_for(predicate) -> None:
        deadline = time.monotonic() + 60
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.01)

    wait_for(lambda: beat() >= 3)  # it beats
    real, failed = store.write_bytes, threading.Event()

    def fail_once(rel, data):
        if not failed.is_set():
            failed.set()
            raise OSError("the store is away\nsecond line")
        return real(rel, data)

    monkeypatch.setattr(store, "write_bytes", fail_once)
    with caplog.at_level("WARNING", logger=lock_mod.logger.name):
        wait_for(failed.is_set)
        after = beat()
        wait_for(lambda: beat() > after)  # the next beat writes again
    assert f"could not refresh the lock {lock_mod.lock_rel(2, store)}: the store is away" in caplog.text
    assert "second line" not in caplog.text and kills == []
    taken = {**lock_mod.read_lock(store, 2), "run_id": "run-b", "beat": 1}
    # Another launcher took it over, and keeps its record there as its own heartbeat would: a beat of ours already
    # past its look may write ours back once, and the next look must still find the other's.
    with caplog.at_level("ERROR", logger=lock_mod.logger.name):
        deadline = time.monotonic() + 60
        while not stopped.wait(0.05):
            assert time.monotonic() < deadline, "the holder never noticed the takeover"
            real(lock_mod.lock_rel(2, store), json.dumps(taken).encode())
    assert kills == [(os.getpid(), signal.SIGTERM)]
    assert f"lost the lock {lock_mod.lock_rel(2, store)} to another run; stopping" in caplog.text
    held._beating.join(timeout=60)
    assert not held._beating.is_alive() and lock_mod.read_lock(store, 2) == taken  # it wrote nothing more
    held.release()
    assert lock_mod.read_lock(store, 2) == taken  # a lock taken over is not its to delete


def test_a_lock_that_cannot_be_cleared_or_removed_is_released_with_a_warning(tmp_path, s3, monkeypatch, caplog):
    """A release never fails the end of a run: on disk, a record that cannot be emptied (the folder remounted
    read-only) is a warning naming the lock, and the flock goes all the same (the next run takes the lock); on an
    object store, a lock object that cannot be deleted is a one-line warning (its heartbeat has stopped: the next run
    takes it over once stale). Released, neither is held any more."""
    import errno

    from launcher.ledger import lock as lock_mod
    from launcher.ledger.store import Store

    disk = Store(tmp_path)
    held = lock_mod.RunLock(disk, 0, "run-a")
    held.acquire()

    def read_only(fd, length):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(lock_mod.os, "ftruncate", read_only)
    with caplog.at_level("WARNING", logger=lock_mod.logger.name):
        held.release()
    assert "could not clear the lock locks/worker-00000.lock: [Errno 30] Read-only file system" in caplog.text
    holder, alive = lock_mod.look(disk, 0)  # its record stays, and the kernel says nobody holds it
    assert holder["run_id"] == "run-a" and not alive
    monkeypatch.undo()
    with lock_mod.RunLock(disk, 0, "run-b") as second:  # the flock went with the release
        assert second.held()
    assert not second.held()  # released and cleared

    store = Store("s3://meshgen-test/release")
    held = lock_mod.RunLock(store, 1, "run-c")
    held.acquire()

    def refused(rel):
        raise OSError("access denied\nrequest id 42")

    monkeypatch.setattr(store, "delete", refused)
    caplog.clear()
    with caplog.at_level("WARNING", logger=lock_mod.logger.name):
        held.release()
    assert f"could not remove the lock {lock_mod.lock_rel(1, store)}: access denied" in caplog.text
    assert "request id" not in caplog.text and lock_mod.read_lock(store, 1)["run_id"] == "run-c"
    assert not held._beating.is_alive()  # its heartbeat stopped: the lock goes stale


def test_a_lock_on_a_store_that_refuses_writes_is_exit_3_with_one_line_and_other_errors_propagate(
    tmp_path, monkeypatch
):
    """DESIGN exit codes: an output folder that refuses the run's first writes is exit 3, nothing lost, one line
    that says how to finish; an error that is no refusal (an I/O error) is not dressed up as one."""
    import errno

    from launcher.errors import OutputRefused
    from launcher.ledger import lock as lock_mod
    from launcher.ledger.store import Store

    store = Store(tmp_path / "out")

    def refusing(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system\nmore")

    monkeypatch.setattr(lock_mod.os, "open", refusing)
    with pytest.raises(OutputRefused) as e:
        lock_mod.RunLock(store, 0, "run-a").acquire()
    assert e.value.exit_code == 3 and str(e.value) == (
        f"{store} refuses writes ([Errno 30] Read-only file system): its lock cannot be taken; make it writable "
        "again and run the same command to finish"
    )

    def broken(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(lock_mod.os, "open", broken)
    with pytest.raises(OSError) as e:
        lock_mod.RunLock(store, 0, "run-a").acquire()
    assert e.type is OSError and e.value.errno == errno.EIO


def test_an_object_store_lock_of_a_dead_run_is_taken_over_and_a_takeover_lost_meanwhile_is_refused(s3, monkeypatch):
    """DESIGN: a lock whose holder is a dead process of this very machine is taken over at once (write, wait, read
    back); of two launchers taking over at once the one whose record is read back wins, and the other exits 4 naming
    it, with '?' for what its record does not say."""
    import socket

    from launcher.errors import LockHeld
    from launcher.ledger import lock as lock_mod
    from launcher.ledger.store import Store

    store = Store("s3://meshgen-test/takeover")
    rel = lock_mod.lock_rel(0, store)
    dead = {"host": socket.gethostname(), "pid": 2**22 + 12345, "pid_space": lock_mod.PID_SPACE, "run_id": "dead"}
    store.write_bytes(rel, json.dumps(dead).encode())
    waits = []
    monkeypatch.setattr(lock_mod.time, "sleep", waits.append)
    with lock_mod.RunLock(store, 0, "run-a") as taker:
        assert waits == [2] and lock_mod.read_lock(store, 0)["run_id"] == "run-a" and taker.held()

    store.write_bytes(rel, json.dumps(dead).encode())
    rival = {"run_id": "rival"}  # another launcher's record, read back after the wait: it names nothing else

    def rival_writes(seconds):
        store.write_bytes(rel, json.dumps(rival).encode())

    monkeypatch.setattr(lock_mod.time, "sleep", rival_writes)
    with pytest.raises(LockHeld) as e:
        lock_mod.RunLock(store, 0, "run-b").acquire()
    assert e.value.exit_code == 4 and str(e.value) == (
        f"another run is active on {store} (workers.index=0): host ?, pid ?, started ?; wait for it to finish or "
        "stop it"
    )
    assert lock_mod.read_lock(store, 0) == rival  # the loser writes nothing more


def test_the_gcs_probe_lists_one_object_and_a_silent_server_is_an_error_within_its_bound(gcs, silent_hub, monkeypatch):
    """launcher/ledger/gcs.py: the preflight's look at a gs:// output folder lists at most one object; an unknown
    bucket is the store's error; a server that never answers is an error within GCS_PROBE_S, with no retry
    (google's client retries for 2 minutes by default)."""
    import time

    from google.api_core.exceptions import NotFound

    from launcher.ledger import gcs as gcs_mod

    asked = []
    real = gcs_mod.gcs_client

    def client():
        c = real()
        list_blobs = c.list_blobs
        c.list_blobs = lambda *a, **kw: asked.append((a, kw)) or list_blobs(*a, **kw)
        return c

    monkeypatch.setattr(gcs_mod, "gcs_client", client)
    gcs_mod.probe_gcs("gs://meshgen-test/some/folder")
    assert asked == [(("meshgen-test",), {"prefix": "some/folder", "max_results": 1, "timeout": 10, "retry": None})]
    with pytest.raises(NotFound):
        gcs_mod.probe_gcs("gs://no-such-bucket-here/x")
    url, paths = silent_hub
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
    monkeypatch.setattr(gcs_mod, "GCS_PROBE_S", 0.5)
    began = time.monotonic()
    with pytest.raises(Exception) as e:
        gcs_mod.probe_gcs("gs://meshgen-test/away")
    assert "timed out" in str(e.value).lower() or "timeout" in type(e.value).__name__.lower(), repr(e.value)
    assert time.monotonic() - began < 30  # not retried for minutes
    assert "/storage/v1/b/meshgen-test/o?maxResults=1&projection=noAcl&prefix=away&prettyPrint=false" in paths


@pytest.mark.parametrize(
    ("env", "url"),
    [(None, None), ("", None), (" ", None), ("127.0.0.1:4443", "http://127.0.0.1:4443"),
     ("http://h:1/", "http://h:1"), (" https://h:2// ", "https://h:2")],
)  # fmt: skip
def test_storage_emulator_host_is_read_as_googles_clients_read_it(env, url, monkeypatch):
    """launcher/ledger/gcs.py: STORAGE_EMULATOR_HOST names a local GCS server with or without its scheme (http://
    where it has none), with or without a trailing slash; unset or blank, the real GCS. A gs:// address is the
    bucket and path without the scheme or a trailing slash."""
    from launcher.ledger import gcs as gcs_mod

    if env is None:
        monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    else:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", env)
    assert gcs_mod.gcs_emulator() == url
    if url is not None:
        fs, path = gcs_mod.open_gcs("gs://bucket/some/folder/")
        assert path == "bucket/some/folder"
        options = fs.__reduce__()[1][0]  # what the filesystem pickles: its options (pyarrow's own default: http)
        assert f"{options['scheme']}://{options['endpoint_override']}" == url and options["anonymous"]


def test_a_prompt_id_that_is_another_prompts_sample_id_is_refused_in_either_order_and_both_forms():
    """DESIGN, sample ids: `<prompt id>-<k>` with images per prompt, `<base id>@<v>` with a sweep (so `a-1@0` with
    both, and `b@0` with a sweep of one value); a prompt id that another prompt's sample id repeats is refused,
    whichever comes first, naming what makes the sample ids."""
    from launcher.errors import ConfigError
    from launcher.plan.shards import check_sample_ids, settings_diff

    both, sweep = "generate.images_per_prompt=2 and generate.sweep", "generate.sweep"
    cases = [(["a", "a-1@0"], 2, 2, "a", "a-1@0", both), (["a-1@0", "a"], 2, 2, "a", "a-1@0", both),
             (["b", "b@0"], 1, 1, "b", "b@0", sweep), (["b@0", "b"], 1, 1, "b", "b@0", sweep)]  # fmt: skip
    for ids, n, variants, prompt, sample, what in cases:
        with pytest.raises(ConfigError) as e:
            check_sample_ids(ids, n, "dataset d", variants)
        assert str(e.value) == (
            f"dataset d: with {what}, prompt {prompt!r} has a sample id {sample!r}, which is also the id of another "
            "prompt; rename one of them (or use dataset.id_column)"
        ), (ids, str(e.value))
    check_sample_ids(["a", "a-2@0", "a-1@2"], 2, "dataset d", 2)  # k past N, v past the variants: no clash
    # a resume across jobs names them (a settings file from before `job` was recorded is text_to_image)
    assert settings_diff({}, {"job": {"name": "edit"}}) == ["job: 'text_to_image' -> 'edit'"]
    assert settings_diff({"job": {"name": "edit"}}, {}) == ["job: 'edit' -> 'text_to_image'"]


def test_an_edit_shards_extra_columns_keep_datasets_image_features_and_its_tar_json_holds_no_image(tmp_path):
    """launcher/writer/writer.py, stream.py: with references, a reference image, a kept column and the quality
    columns, `datasets` still reads `image` and `reference_image` as Image features from the Parquet's schema (its
    own reading of the schema is the judge), the scores as float32 and bool; a WebDataset sample's JSON holds the
    row's columns but its images (docs/guide.md: `<id>.json` per sample)."""
    import tarfile

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from launcher.config import load_config
    from launcher.ledger.store import Store
    from launcher.writer.stream import ShardStream
    from launcher.writer.writer import KEPT_FIELDS

    sample = {"id": "a", "prompt": "p", "seed": 7, "height": 8, "width": 8, "model": "m", "encoded": b"png-a"}
    sample |= {"reference": [{"id": "r", "path": "r.png", "sha256": "0" * 64}]}
    sample |= {"reference_image": {"bytes": b"ref", "path": "r.png"}, "clip_score": 31.5, "nsfw": False}
    sample |= {"source": "lake", KEPT_FIELDS: (pa.field("source", pa.string()),)}
    cfg = load_config("tiny", ["output.webdataset=true"]).output
    stream = ShardStream(Store(tmp_path), "shard-00000", cfg)
    stream.add([dict(sample)])
    stream.commit()
    features = datasets.Features.from_arrow_schema(pq.read_schema(tmp_path / "data" / "shard-00000.parquet"))
    assert isinstance(features["image"], datasets.Image) and isinstance(features["reference_image"], datasets.Image)
    assert features["clip_score"] == datasets.Value("float32") and features["nsfw"] == datasets.Value("bool")
    assert features["source"] == datasets.Value("string")
    with tarfile.open(tmp_path / "webdataset" / "shard-00000.tar") as tar:
        meta = json.loads(tar.extractfile("a.json").read())
    assert "image" not in meta and "reference_image" not in meta
    assert meta["reference"] == sample["reference"] and meta["clip_score"] == 31.5 and meta["source"] == "lake"


def test_the_card_names_its_features_its_sweep_and_its_encoding(tmp_path):
    """docs/guide.md: the card's front matter holds the features (the image an Image), its body the encoding
    (`webp (lossless)` with output.lossless) and, with a sweep, its variants and DESIGN's sample ids `<base id>@<v>`;
    the Hub finds it by its task and tags."""
    import types

    import yaml

    from launcher.config import load_config
    from launcher.ledger.runs import write_run_json
    from launcher.ledger.states import state_rel
    from launcher.ledger.store import Store
    from launcher.publish import card
    from launcher.writer.stream import ShardStream

    store = Store(tmp_path)
    job = ["model.path=org/tiny", "model.build=null", "output.format=webp", "output.lossless=true"]
    cfg = load_config("tiny", [*job, "generate.sweep={guidance_scale:[2.5,4.0]}"])
    write_run_json(store, cfg, 1)
    out = types.SimpleNamespace(format="webp", parquet=True, webdataset=False, image_files=False, row_group_size=2)
    stream = ShardStream(store, "shard-00000", out)
    stream.add([_stream_sample(0)])
    store.write_json(state_rel(0), {"status": "done", "rows": 1, "seconds": 1.0, "run_id": "r", **stream.commit()})
    text = card.card_text(store)
    front = yaml.safe_load(text.split("---\n")[1])
    assert {"name": "image", "dtype": "image"} in front["dataset_info"]["features"]
    assert front["task_categories"] == ["text-to-image"] and front["tags"] == ["synthetic"]
    assert "- images: webp (lossless), stored as the `image` column's bytes" in text
    assert "every prompt at 2 combinations of settings" in text and "`<base id>@<v>`" in text
    assert "v = 0: guidance_scale=2.5; 1: guidance_scale=4.0" in text
    edited = Store(tmp_path / "edited")
    write_run_json(edited, load_config("tiny", [*job, "job=edit"]), 1)  # an edit job's dataset: image to image
    assert yaml.safe_load(card.card_text(edited).split("---\n")[1])["task_categories"] == ["image-to-image"]


def test_a_states_token_is_its_attempt_else_its_finish_time_else_its_run():
    """launcher/ledger/states.py: what tells one written state from another without comparing clocks: the attempt
    that wrote it; a state from before attempts were recorded by its own finish time, or else by its run id."""
    from launcher.ledger.states import state_token

    assert state_token({"attempt": "run-1:g2", "finished_at": 1.5, "run_id": "run-1"}) == "run-1:g2"
    assert state_token({"finished_at": 1.5, "run_id": "run-1"}) == "1.5"
    assert state_token({"status": "done", "run_id": "run-1"}) == "run-1"
    assert state_token({"status": "done"}) is None and state_token(None) is None


def test_non_finite_values_in_a_numpy_output_name_their_samples_as_a_tensors_do():
    """jobs/text_to_image.py check_finite: values one per image, as a torch tensor or a numpy array (a pipeline's
    `np` output): the samples with a NaN or an inf anywhere are named, the padding past the batch's real samples
    is not looked at."""
    import types

    import numpy as np
    import torch

    from jobs.text_to_image import NonFiniteOutput, check_finite

    batch = types.SimpleNamespace(image_ids=lambda: ["a-0", "a-1", "b-0"])
    values = np.zeros((4, 2, 3, 3), np.float32)  # 3 real samples and one of padding
    values[3, 0, 0, 0] = np.nan
    for v in (values, torch.from_numpy(values)):
        check_finite(batch, v, "vae")  # the padding's NaN is not a sample's
    values[1, 1, 2, 2], values[2, 0, 0, 1] = np.inf, np.nan
    for v in (values, torch.from_numpy(values)):
        with pytest.raises(NonFiniteOutput, match=r"^the vae gave non-finite values \(NaN or inf\) for sample 'a-1', "):
            check_finite(batch, v, "vae")
        with pytest.raises(NonFiniteOutput, match=r"'a-1', 'b-0' \(2 of 3 in the batch\)"):
            check_finite(batch, v, "vae")


def test_an_object_store_output_dir_is_checked_at_the_store_and_its_error_is_in_the_line(s3, monkeypatch):
    """launcher/checks/settings.py: an s3:// output.dir is checked at the store (nothing made here): a bucket that
    is not there, or a store that refuses the connection, is one line with what the store said."""
    import socket

    from launcher.checks.settings import check_output

    def check(url: str) -> str:
        with pytest.raises(ConfigError) as e:
            check_output(OmegaConf.create({"output": {"dir": url}}))
        return str(e.value)

    check_output(OmegaConf.create({"output": {"dir": "s3://meshgen-test/run"}}))
    assert check("s3://no-such-bucket/run").startswith(
        "output.dir=s3://no-such-bucket/run cannot be reached (no such bucket)"
    )
    with socket.socket() as s:  # a port where nothing listens: the connection is refused at once
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{s.getsockname()[1]}")
        line = check("s3://meshgen-test/run")
    said = line.removeprefix("output.dir=s3://meshgen-test/run cannot be reached (").split("); check the bucket")[0]
    assert said != line and "meshgen-test" in said, line  # the client's own first line, naming the bucket


def test_an_output_dir_where_no_file_can_be_made_is_one_line():
    """/proc takes no new file (as root too): the probe is made where the folder would be, not elsewhere."""
    from launcher.checks.settings import check_output

    with pytest.raises(
        ConfigError, match=r"^output.dir /proc/meshgen-out cannot be written \(creating a file in /proc"
    ):
        check_output(OmegaConf.create({"output": {"dir": "/proc/meshgen-out"}}))


def test_only_the_first_host_checks_that_the_rendezvous_port_is_free(monkeypatch):
    """preflight.py store_port: on a job over several hosts the first host (NODE_RANK 0) serves the store on
    MASTER_PORT, which must be free; the others connect to it and never bind it."""
    import socket

    from launcher.checks.preflight import store_port

    pf = types.SimpleNamespace(cfg=OmegaConf.create({"mesh": {"nodes": 2}}))
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        monkeypatch.setenv("MASTER_PORT", str(held.getsockname()[1]))
        monkeypatch.setenv("NODE_RANK", "1")
        store_port(pf)
        monkeypatch.setenv("NODE_RANK", "0")
        with pytest.raises(ConfigError, match=f"^MASTER_PORT {held.getsockname()[1]} cannot be bound on this host"):
            store_port(pf)


def test_a_download_error_without_words_is_named_by_its_type(monkeypatch, tmp_path):
    """download.py: every failure of the download is one line, its cause's first line or, where it says nothing,
    its type."""
    from launcher.checks import download

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(download, "complete_in_cache", lambda path: False)

    def silent(path, what):
        raise RuntimeError("  ")

    monkeypatch.setattr(download, "hub_answers", silent)
    with pytest.raises(ConfigError, match=r"^cannot download model.path org/m from \S+ \(RuntimeError\); check"):
        download.ensure_downloaded("org/m")


def test_a_lora_scale_is_taken_at_its_bounds_and_refused_past_them():
    """docs/guide.md: a LoRA's scale outside -100..100 is refused; the bounds themselves are scales."""
    from launcher.checks.settings import check_model_values

    def cfg(scale: float):
        return OmegaConf.create({"model": {"loras": [{"path": "l.safetensors", "scale": scale}]}, "generate": {}})

    for scale in (-100, 100, 0, 1.5):
        check_model_values(cfg(scale))
    for scale in (-100.5, 100.5, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="scale"):
            check_model_values(cfg(scale))


def test_a_quality_model_in_a_local_folder_named_like_a_hub_id_is_never_fetched(tmp_path, monkeypatch):
    """quality_models.py: a folder is read as it is, even one whose relative path looks like a hub id
    ("models/clip"); only a path that is no folder and looks like an id is fetched."""
    from launcher.checks import download, quality_models

    asked = []
    monkeypatch.setattr(download, "hub_answers", lambda path, what: asked.append(path) or 1 / 0)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "clip").mkdir(parents=True)
    quality_models._fetch("models/clip", "quality.clip_model")
    assert asked == []
    with pytest.raises(ZeroDivisionError):  # the same name with no folder there: asked of the hub
        quality_models._fetch("models/other", "quality.clip_model")
    assert asked == ["models/other"]


def test_a_gcs_output_dir_whose_server_never_answers_is_one_line_within_the_probes_wait(silent_s3, monkeypatch):
    """settings.py / gcs.py: a gs:// output.dir is looked at with one bounded request (GCS_PROBE_S, no retry):
    pyarrow's own client would wait minutes on a server that accepts and never answers. The server here is the
    silent one, as a GCS emulator address; with the probe's wait at 0.5 s the check ends within seconds."""
    import threading

    from launcher.checks.settings import check_object_store
    from launcher.ledger import gcs

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", os.environ["AWS_ENDPOINT_URL"])
    monkeypatch.setattr(gcs, "GCS_PROBE_S", 0.5)
    said: list[str] = []

    def check():
        try:
            check_object_store("gs://meshgen-test/run")
        except ConfigError as e:
            said.append(str(e))

    worker = threading.Thread(target=check, daemon=True)
    worker.start()
    worker.join(timeout=15)
    assert not worker.is_alive(), "the check of a silent GCS server still waits after 15 s"
    assert said and said[0].startswith("output.dir=gs://meshgen-test/run cannot be reached ("), said


def test_a_gcs_emulator_address_without_its_scheme_reaches_the_server_in_both_clients(gcs, monkeypatch):
    """launcher/ledger/gcs.py: STORAGE_EMULATOR_HOST as host:port (as fake-gcs-server's docs give it) reaches the
    server in pyarrow's client and in google-cloud-storage's (the conditional create), which reads it only with a
    scheme of its own accord."""
    from launcher.ledger.store import Store

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs["STORAGE_EMULATOR_HOST"].removeprefix("http://"))
    store = Store("gs://meshgen-test/bare-host")
    assert store.create_exclusive("lock", b"one") and not store.create_exclusive("lock", b"two")
    assert store.read_bytes("lock") == b"one"


def test_releasing_a_shard_this_run_does_not_hold_deletes_no_claim():
    """launcher/ledger/claims.py release: only our own claim goes (and the dead generations below it); a shard we do
    not hold (taken over, or never claimed) is left as it is, its holder's claim in place."""
    import tempfile

    from launcher.ledger.claims import Claims
    from launcher.ledger.store import Store

    with tempfile.TemporaryDirectory() as folder:
        store = Store(folder)
        store.write_bytes("claims/shard-00003/g00000.json", b'{"worker": 1, "run_id": "another"}')
        Claims(store, 0, "ours").release(3)
        assert store.read_bytes("claims/shard-00003/g00000.json") == b'{"worker": 1, "run_id": "another"}'


def test_an_edit_jobs_interpolated_size_reaches_the_pipeline_as_its_value(tmp_path):
    """A YAML value that names another (`width: ${generate.height}`, OmegaConf's interpolation, as Hydra composes
    it) is that value by the time a call is made."""
    from jobs import edit

    cfg = job_cfg()
    cfg.generate.width = "${generate.height}"
    data = png("blue", (4, 4))
    (tmp_path / "r.png").write_bytes(data)
    where = json.dumps([{"path": "r.png", "src": str(tmp_path / "r.png")}])
    rows = [{"id": "b", "prompt": "q", "ref_sha256": hashlib.sha256(data).hexdigest(), "ref_loc": where}]
    pipe = FakePipeline()
    edit.run_batch(pipe, edit.shard_batches(rows, cfg)[0], cfg)
    assert (pipe.calls[0]["height"], pipe.calls[0]["width"]) == (32, 32)


def test_a_crop_whose_margins_are_odd_is_the_size_asked_for():
    """jobs/edit.py fit_image: `crop` covers the size and cuts the middle out, whole pixels: a 10x10 reference
    brought to 16x15 is scaled to 16x16 and one row is cut (none at the top, one at the bottom)."""
    from jobs.edit import fit_image

    im = Image.new("RGB", (10, 10), (0, 0, 255))
    im.paste((255, 0, 0), (0, 0, 10, 1))  # a red top row: 1.6 rows once scaled
    out = fit_image(im, 16, 15, "crop")
    assert out.size == (16, 15) and out.getpixel((8, 0))[0] > 200  # the top row kept


def test_a_loras_scale_defaults_to_1():
    """DESIGN: model.loras entries are {path, scale}, scale default 1.0: the scales they were fused at."""
    from jobs.text_to_image import loaded_lora_scales

    loras = [{"path": "a.safetensors"}, {"path": "b.safetensors", "scale": 0.5}]
    assert loaded_lora_scales(OmegaConf.create({"model": {"loras": loras}})) == (1.0, 0.5)


def test_the_quality_columns_are_written_without_kept_columns_too(tmp_path):
    """DESIGN (quality.*): clip_score (float32) and nsfw (bool) are columns of each row, with their `datasets`
    features, whether or not source columns are kept beside them."""
    import types

    import pyarrow.parquet as pq

    from launcher.ledger.store import Store
    from launcher.writer.stream import ShardStream

    out = types.SimpleNamespace(format="png", parquet=True, webdataset=False, image_files=False, row_group_size=2)
    stream = ShardStream(Store(tmp_path), "shard-00000", out)
    stream.add([{**_stream_sample(i), "clip_score": 30.5 + i, "nsfw": i == 1} for i in range(3)])
    stream.commit()
    table = pq.read_table(tmp_path / "data" / "shard-00000.parquet")
    assert table.schema.field("clip_score").type == "float" and table.schema.field("nsfw").type == "bool"
    assert table.column("clip_score").to_pylist() == [30.5, 31.5, 32.5]
    assert table.column("nsfw").to_pylist() == [False, True, False]
    features = json.loads(table.schema.metadata[b"huggingface"])["info"]["features"]
    assert features["clip_score"] == {"dtype": "float32", "_type": "Value"} and features["nsfw"]["dtype"] == "bool"


def test_the_memory_plan_adds_every_loras_file(tmp_path):
    """launcher/sizing/mesh_plan.py lora_bytes: each rank reads every LoRA file whole while fusing: the plan adds
    all of their bytes, not the last one's."""
    from launcher.config import load_config
    from launcher.sizing.mesh_plan import lora_bytes

    (tmp_path / "a.safetensors").write_bytes(b"a" * 1000)
    (tmp_path / "b.safetensors").write_bytes(b"b" * 24)
    loras = f"model.loras=[{{path:{tmp_path / 'a.safetensors'}}},{{path:{tmp_path / 'b.safetensors'}}}]"
    assert lora_bytes(load_config("tiny", [loras])) == 1024


def test_one_process_on_a_host_has_the_whole_hosts_share_for_its_images(monkeypatch):
    """launcher/sizing/work_bounds.py: a worker's images in flight (a call's float32 output, then up to
    output.queue_shards + 2 batches as uint8) must fit in half of the host's memory over its processes; the mesh
    plan counts the processes: one process (dp=1, tp=1) has the whole half. A host whose half holds the images 1.5
    times takes them with one process."""
    from launcher.config import load_config
    from launcher.sizing import work_bounds
    from launcher.sizing.mesh_plan import plan_mesh

    cfg = load_config("tiny", ["mesh.dp=1", "mesh.tp=1", "generate.batch_size=2", "output.queue_shards=1"])
    g = cfg.generate
    held = g.batch_size * g.images_per_prompt * g.height * g.width * 3 * (4 + 1 + 2)
    monkeypatch.setattr(work_bounds, "_host_bytes", lambda: int(held * 1.5 / 0.5))
    plan_mesh(cfg, "cpu", None)
    cfg.mesh.dp = 2  # two processes: each has half of that, less than its images
    with pytest.raises(ConfigError, match=r"^one pipeline call makes 2 images .* over its 2 processes\)"):
        plan_mesh(cfg, "cpu", None)


def _failed_job(i: int):
    """A shard that failed in generation: the writer only records it (it has no image to write)."""
    from launcher.writer.bgwriter import ShardJob

    return ShardJob(i, f"shard-{i:05d}", [], {"status": "failed", "error": "E: x", "error_class": "E"})


def _in_thread(target, *args):
    """target(*args) in a daemon thread, and what it returned or raised once it ends."""
    import threading

    got: dict = {}

    def run():
        try:
            got["returned"] = target(*args)
        except Exception as e:  # noqa: BLE001 - handed to the test
            got["raised"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, got


@pytest.mark.parametrize("fails", [False, True], ids=["drains", "fails"])
def test_a_full_queue_at_close_is_waited_for_and_a_writer_that_fails_meanwhile_is_raised_to_every_waiter(
    fails, tmp_path
):
    """launcher/writer/bgwriter.py: generation (add) and close() wait for room in the queue (output.queue_shards)
    a second at a time, looking between waits at the writer thread: close() with the queue full for longer than
    one wait still ends once the writer has drained it; a writer thread that fails (here its on_recorded) while
    add() and close() wait is raised to both ("the shard writer stopped: ..."), never waited on for ever. Each
    waiter's tries at the queue are counted: both have begun a second wait before the writer is let go."""
    import threading

    from conftest import until

    from launcher.config import load_config
    from launcher.ledger.store import Store
    from launcher.writer.bgwriter import BackgroundWriter

    entered, release, recorded = threading.Event(), threading.Event(), []
    tries = {"add": 0, "close": 0}

    def counted(put):  # the queue's put, each try of add (a batch) and close (None) counted
        def counted_put(item, block=True, timeout=None):
            if item is None or type(item).__name__ == "_Batch":
                tries["close" if item is None else "add"] += 1
            return put(item, block, timeout)

        return counted_put

    def on_recorded(index: int) -> None:
        entered.set()
        assert release.wait(60)
        if fails:
            raise ValueError("the ledger broke")
        recorded.append(index)

    writer = BackgroundWriter(Store(tmp_path), load_config("tiny", ["output.queue_shards=1"]).output, 1, on_recorded)
    writer._queue.put = counted(writer._queue.put)
    waiters = []
    try:
        writer.submit(_failed_job(0))
        assert entered.wait(60)  # the writer thread holds shard 0
        writer.submit(_failed_job(1))  # and the queue is full
        waiters.append(adding := _in_thread(writer.add, 2, "shard-00002", []))
        waiters.append(closing := _in_thread(writer.close))
        until(lambda: min(tries.values()) >= 2, timeout_s=60)  # both have waited for room more than once
        assert adding[0].is_alive() and closing[0].is_alive()
        release.set()
        for thread, _ in (closing, adding):
            thread.join(60)
            assert not thread.is_alive(), "still waiting on the writer after 60 s"
    finally:
        release.set()
        for thread, _ in waiters:
            thread.join(60)
    if fails:
        for _, got in (adding, closing):
            assert repr(got.get("raised")) == (
                "RuntimeError(\"the shard writer stopped: ValueError('the ledger broke')\")"
            ), got
    else:
        assert "raised" not in closing[1] and recorded == [0, 1]
        assert "raised" not in adding[1]  # the batch of no image went in behind shard 1 and was dropped at close


def test_a_shard_whose_output_is_full_fails_out_of_space_with_its_traceback_and_its_whole_writer_wait(
    tmp_path, monkeypatch, caplog
):
    """launcher/writer/bgwriter.py: a write the output refuses for want of room fails the shard with the error, its
    class and its traceback (as Python prints it), and marks it and the writer out of space (the launcher's last
    line says so: launcher/sizing/space.py); the seconds submit() waited for room are added to the stage timings'
    writer_wait, to the tenth of a millisecond. Here the full disk refuses the state file's removal, which ZFS and
    btrfs do when full. A shard with no files in the writer process has nothing to drop: no warning."""
    import errno
    import time

    from launcher.config import load_config
    from launcher.ledger.store import Store
    from launcher.writer import bgwriter
    from launcher.writer.bgwriter import BackgroundWriter, ShardJob

    class FullDisk(Store):
        def delete(self, rel: str) -> None:
            if rel == "state/shard-00003.json":
                raise OSError(errno.ENOSPC, "No space left on device")
            super().delete(rel)

    recorded: list[int] = []
    writer = BackgroundWriter(FullDisk(tmp_path), load_config("tiny").output, 1, recorded.append)
    job = ShardJob(3, "shard-00003", [], {"status": "done", "rows": 0, "seconds": 1.0})
    job.state["stages"] = {"denoise": 2.0, "writer_wait": 0.25}  # the batches' waits, as the worker hands them
    clock = iter([10.0, 10.123456])  # submit waited 0.123456 s for room
    monkeypatch.setattr(bgwriter, "time", types.SimpleNamespace(perf_counter=lambda: next(clock), time=time.time))
    try:
        assert writer.submit(job) == pytest.approx(0.123456)
    finally:
        monkeypatch.setattr(bgwriter, "time", time)
    with caplog.at_level("WARNING"):
        writer.close()
    state = json.loads((tmp_path / "state" / "shard-00003.json").read_text())
    assert state["stages"] == {"denoise": 2.0, "writer_wait": 0.3735}
    assert (state["status"], state["error_class"]) == ("failed", "OSError")
    assert state["error"] == "OSError while writing: [Errno 28] No space left on device"
    lines = state["traceback"].splitlines()
    assert lines[0] == "Traceback (most recent call last):" and lines[1].startswith('  File "'), lines
    assert lines[-1] == "OSError: [Errno 28] No space left on device"
    assert state["out_of_space"] is True and writer.out_of_space is True and recorded == [3]
    assert "could not be dropped" not in caplog.text


def test_each_attempt_of_a_shard_in_one_writer_starts_from_nothing_and_a_batch_dropped_for_a_lost_claim_fails_it(
    tmp_path,
):
    """launcher/writer/bgwriter.py, one shard's attempts in the same writer: a batch that reaches the writer after
    our claim was taken over is dropped, and the shard fails naming why, even where the claim is ours again by its
    end (never done without the dropped rows); its next attempt is written whole (the failure is not held against
    it) and its first batch removes the failed state; an attempt taken over at its end is left to the new holder,
    and once claimed again its first batch removes that holder's done state before any of its files change."""
    from conftest import until
    from test_runtime_bounds import _samples as samples

    from launcher.config import load_config
    from launcher.ledger.store import Store
    from launcher.writer.bgwriter import BackgroundWriter, ShardJob

    held, asked, recorded, lost = {0: False}, [], [], []
    store, state = Store(tmp_path), tmp_path / "state" / "shard-00000.json"

    def still_held(index: int) -> bool:
        asked.append(index)
        return held[index]

    writer = BackgroundWriter(store, load_config("tiny").output, 1, recorded.append, still_held, lost.append)

    def end(rows: int) -> None:
        writer.submit(ShardJob(0, "shard-00000", [], {"status": "done", "rows": rows, "seconds": 1.0}))

    try:
        writer.add(0, "shard-00000", samples(["a"], 0, first=0))
        until(lambda: asked)  # the batch met a claim taken over: dropped
        held[0] = True  # ours again (the other run gave it up) by the shard's end
        end(1)
        until(lambda: recorded == [0])
        first = json.loads(state.read_text())
        assert (first["status"], first["error"]) == (
            "failed",
            "RuntimeError while writing: our claim on shard 0 was taken over mid-shard",
        )
        writer.add(0, "shard-00000", samples(["b", "c"], 1, first=0))  # the next attempt
        until(lambda: not state.exists(), timeout_s=10)
        end(2)
        until(lambda: recorded == [0, 0])
        assert json.loads(state.read_text())["status"] == "done"
        writer.add(0, "shard-00000", samples(["d"], 2, first=0))  # a third, taken over at its end
        until(lambda: not state.exists(), timeout_s=10)
        held[0] = False
        end(1)
        until(lambda: lost == [0])
        store.write_json("state/shard-00000.json", {"status": "done", "rows": 1, "run_id": "another"})
        held[0] = True  # claimed again
        writer.add(0, "shard-00000", samples(["e"], 3, first=0))
        until(lambda: not state.exists(), timeout_s=10)
        end(1)
    finally:
        writer.close()
    assert recorded == [0, 0, 0] and lost == [0] and writer.failed == [0]
    assert json.loads(state.read_text())["status"] == "done"
    assert pq_ids(tmp_path / "data" / "shard-00000.parquet") == ["e"]


def pq_ids(path) -> list:
    import pyarrow.parquet as pq

    return pq.read_table(path)["id"].to_pylist()


def _stream_cfg(**settings):
    """Output settings as the writer process gets them (a SimpleNamespace of plain values): PNG, Parquet only,
    row groups of 2, unless `settings` says otherwise."""
    base = {"format": "png", "parquet": True, "webdataset": False, "image_files": False, "row_group_size": 2}
    return types.SimpleNamespace(**(base | settings))


def test_a_shard_without_parquet_is_committed_and_aborted_as_one_with_it(tmp_path):
    """launcher/writer/stream.py with output.parquet=false: the image files and the WebDataset tar are committed
    whole, and the state keeps their sizes and hashes and no Parquet size (it is sound: launcher/ledger/states.py);
    aborted, before or after its first batch, such a shard leaves nothing and raises nothing."""
    from launcher.ledger.states import parse_state
    from launcher.ledger.store import Store
    from launcher.writer.stream import ShardStream

    cfg = _stream_cfg(parquet=False, webdataset=True, image_files=True, row_group_size=1)
    stream = ShardStream(Store(tmp_path), "shard-00000", cfg)
    stream.add([_stream_sample(1), _stream_sample(0)])
    record = stream.commit()
    assert sorted(record) == ["files"]
    assert sorted(record["files"]) == [
        "images/shard-00000/s0.png",
        "images/shard-00000/s1.png",
        "webdataset/shard-00000.tar",
    ]
    state, damaged = parse_state(json.dumps({"status": "done", "rows": 2, "seconds": 1.0, **record}).encode())
    assert damaged is None and state["files"] == record["files"]
    ShardStream(Store(tmp_path), "shard-00001", cfg).abort()  # nothing handed over yet
    stream = ShardStream(Store(tmp_path), "shard-00002", cfg)
    stream.add([_stream_sample(0)])
    stream.abort()
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == sorted(["images", "images/shard-00000", "webdataset", *record["files"]])  # no hidden leftover


def test_samples_in_their_turn_are_written_as_they_come_and_those_early_wait_for_it(tmp_path):
    """launcher/writer/stream.py: a sample whose turn it is goes to the shard's files at once (here its image into
    the shard's hidden image folder), and so do those that waited for it; one that comes early waits, and the
    shard's rows keep its order. The Parquet is zstd-compressed (docs/reference.md, output.row_group_size)."""
    import pyarrow.parquet as pq

    from launcher.ledger.store import Store
    from launcher.writer.stream import ShardStream

    stream = ShardStream(Store(tmp_path), "shard-00000", _stream_cfg(image_files=True))
    [hidden] = list((tmp_path / "images").iterdir())  # shard-00000's folder until commit

    written = []
    for batch in ([1], [0], [2], [3]):
        stream.add([_stream_sample(i) for i in batch])
        written.append(len(list(hidden.iterdir())))
    assert written == [0, 2, 3, 4]
    stream.commit()
    meta = pq.ParquetFile(tmp_path / "data" / "shard-00000.parquet").metadata
    assert pq_ids(tmp_path / "data" / "shard-00000.parquet") == ["s0", "s1", "s2", "s3"]
    codecs = {
        meta.row_group(g).column(c).compression for g in range(meta.num_row_groups) for c in range(meta.num_columns)
    }
    assert codecs == {"ZSTD"}


def test_the_writer_process_commits_a_shard_of_no_batch_and_a_full_disk_at_commit_is_the_error(tmp_path, monkeypatch):
    """launcher/writer/writer_process.py `_finish`: a shard that handed no batch over (all its rows set aside: an
    empty shard of the plan) still gets its empty files; a disk that fills when the Parquet is committed, after its
    image folder was put in place, fails the shard with that error (the writer then knows the output is full), not
    with one from cleaning up."""
    import contextlib
    import errno

    import pyarrow.parquet as pq
    from test_runtime_bounds import _samples as samples

    from launcher.ledger.store import Store
    from launcher.writer import writer_process as wp

    class FullAtCommit(Store):
        @contextlib.contextmanager
        def open_output(self, rel: str):
            with super().open_output(rel) as f:
                yield f
                raise OSError(errno.ENOSPC, "No space left on device")

    cfg = _stream_cfg(quality=95, lossless=False, png_encoder="imagecodecs", png_level=1, webp_method=0)
    monkeypatch.setattr(wp, "_OUT", {"store": Store(tmp_path), "cfg": cfg, "encoders": None})
    monkeypatch.setattr(wp, "_STREAMS", {})
    assert sorted(wp._finish("shard-00005")["files"]) == ["data/shard-00005.parquet"]
    assert pq.read_table(tmp_path / "data" / "shard-00005.parquet").num_rows == 0
    wp._OUT.update(store=FullAtCommit(tmp_path), cfg=types.SimpleNamespace(**{**vars(cfg), "image_files": True}))
    wp._add_batch("shard-00006", samples(["a"], 0, first=0))
    with pytest.raises(OSError) as e:
        wp._finish("shard-00006")
    assert e.value.errno == errno.ENOSPC


def test_the_writer_processs_encoders_are_as_many_as_asked_die_with_it_and_are_gone_once_stopped(tmp_path, monkeypatch):
    """launcher/writer/writer_process.py, set up in this process as in the writer process: `encode_workers`
    encoders whatever the host's cores, each asking the kernel to kill it when the writer process dies
    (PR_GET_PDEATHSIG reads SIGKILL in each); a batch of many images per encoder is spread over them and written
    in order; `_stop_encoders` returns once they are gone. pandas is refused by name, its submodules too."""
    import signal
    import sys

    import psutil
    from test_runtime_bounds import _samples as samples

    from launcher.config import load_config

    wp = _writer_process_here(monkeypatch)
    monkeypatch.setattr(wp, "_STREAMS", {})
    monkeypatch.setattr(os, "cpu_count", lambda: 16)  # a host of more cores than the encoders asked for
    plain = types.SimpleNamespace(**OmegaConf.to_container(load_config("tiny").output, resolve=True))
    wp._start_writer(str(tmp_path), plain, 2, os.getpid())
    pool = wp._OUT["encoders"]
    try:
        assert pool._max_workers == 2
        ask = "(lambda c: (lambda v: (c.CDLL(None).prctl(2, c.byref(v)), v.value)[1])(c.c_int()))(__import__('ctypes'))"
        assert {pool.submit(eval, ask).result(timeout=60) for _ in range(6)} == {signal.SIGKILL}
        ids = [f"s{k:02d}" for k in range(12)]  # 6 an encoder: more than the 4 that make a chunk of 1
        wp._add_batch("shard-00000", samples(ids, 0, first=0))
        wp._finish("shard-00000")
        assert pq_ids(tmp_path / "data" / "shard-00000.parquet") == ids
        encoders = [psutil.Process(pid) for pid in pool._processes]
    finally:
        wp._stop_encoders()
    assert [p.pid for p in encoders if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    finder = sys.meta_path[0]
    for name in ("pandas", "pandas.core.frame"):
        with pytest.raises(ModuleNotFoundError, match="the writer process does without pandas"):
            finder.find_spec(name)
    assert finder.find_spec("pandas_like") is None and finder.find_spec("numpy") is None


# A rank that started its writer (two encoders) and then fails, as a worker started with `python -m
# launcher.worker.main` does: its exception ends the interpreter, whose exit handlers run.
RANK_THAT_FAILS = """
import sys
from launcher.config import load_config
from launcher.ledger.store import Store
from launcher.writer.bgwriter import BackgroundWriter
w = BackgroundWriter(Store(sys.argv[1]), load_config("tiny").output, 2, on_recorded=lambda i: None)
w._process.submit(int).result()  # the writer process and its encoders are up
print(*w._process._processes, flush=True)
raise RuntimeError("the model could not be loaded")
"""


def test_a_rank_that_fails_without_closing_its_writer_still_exits(tmp_path):
    """launcher/writer/bgwriter.py: a rank that fails before it closes its writer (two encoders) exits with its
    error, and its writer process ends too: the shard-writer thread, waiting for work, does not hold the
    interpreter's exit (a daemon thread)."""
    import subprocess
    import sys

    import psutil

    rank = subprocess.Popen(
        [sys.executable, "-c", RANK_THAT_FAILS, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = rank.communicate(timeout=60)  # bounded: a rank that never prints nor ends fails the test
    except subprocess.TimeoutExpired:
        for p in psutil.Process(rank.pid).children(recursive=True):
            p.kill()
        rank.kill()
        rank.communicate()
        pytest.fail("the rank still runs 60 s after its error")
    assert rank.returncode == 1 and "RuntimeError: the model could not be loaded" in err, err
    (writer,) = map(int, out.split())
    assert not psutil.pid_exists(writer) or psutil.Process(writer).status() == psutil.STATUS_ZOMBIE


def test_each_encoding_setting_reaches_pillow_and_lossless_webp_takes_the_least_effort():
    """launcher/writer/encode.py: PNG through Pillow at output.png_level (0: stored, larger than the pixels), WebP
    through Pillow at output.webp_method, and lossless WebP at the least effort (level 0: "the level of lossless
    webp is effort") in either library, its pixels kept exactly."""
    import imagecodecs

    from launcher.writer.encode import Encoding, encode

    y, x = np.mgrid[0:256, 0:256]
    noise = np.random.default_rng(0).integers(0, 8, (256, 256)) * 30
    px = np.stack([(x * y) % 251, (x + 3 * y) % 256, noise], -1).astype(np.uint8)

    def pil(**settings) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(px).save(buf, **settings)
        return buf.getvalue()

    stored = encode(px, Encoding("png", png_encoder="pil", png_level=0))
    assert stored == pil(format="PNG", compress_level=0) and len(stored) > px.size
    lossless = encode(px, Encoding("webp", lossless=True))
    assert lossless == pil(format="WEBP", lossless=True, quality=0, method=0)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(lossless)).convert("RGB")), px)
    assert encode(px, Encoding("webp", quality=90), "pil") == pil(format="WEBP", quality=90, method=0)
    assert encode(px, Encoding("webp", lossless=True), "imagecodecs") == bytes(
        imagecodecs.webp_encode(px, level=0, lossless=True, method=0)
    )


def test_an_edit_shards_reference_columns_have_their_datasets_features():
    """launcher/writer/writer.py: the Parquet's `huggingface` metadata gives every column its feature, in the
    columns' order: an edit's `reference` is a list of {id, path, sha256} strings and `reference_image` an Image."""
    from launcher.writer.writer import schema_of

    sample = {"id": "a", "reference": [{"id": "r", "path": "r.png", "sha256": "0" * 64}], "reference_image": {}}
    schema = schema_of([sample])
    features = json.loads(schema.metadata[b"huggingface"])["info"]["features"]
    assert list(features) == schema.names
    text = {"dtype": "string", "_type": "Value"}
    assert features["reference"] == [{"id": text, "path": text, "sha256": text}]
    assert features["reference_image"] == {"_type": "Image"}


def test_a_webdataset_key_may_be_as_long_as_an_id(tmp_path):
    """DESIGN: a sample id may be up to 200 bytes (launcher/sources/row_checks.py); its WebDataset key is its file
    stem, and the tar holds `<key>.png` and `<key>.json` whole (a POSIX tar's plain header has room for 100)."""
    import tarfile

    from launcher.ledger.store import Store

    key = "k" * 200
    _write_shard(Store(tmp_path), [{"id": key, "encoded": b"png"}], "output.webdataset=true")
    with tarfile.open(tmp_path / "webdataset" / "shard-00000.tar") as tar:
        assert tar.getnames() == [f"{key}.png", f"{key}.json"]
        assert tar.extractfile(f"{key}.png").read() == b"png"


def test_an_aborted_shards_parquet_writer_is_closed_at_once_into_nothing(tmp_path, monkeypatch):
    """launcher/writer/stream.py abort: the shard's Parquet writer and tar are closed at once into nothing, so no
    close at garbage collection writes or fails later (pyarrow's __del__ would print a traceback into the worker's
    log); nothing of the shard stays."""
    import gc
    import sys

    from launcher.ledger.store import Store
    from launcher.writer.stream import ShardStream

    unraisable: list = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    stream = ShardStream(Store(tmp_path), "shard-00001", _stream_cfg(webdataset=True))
    stream.add([_stream_sample(i) for i in (1, 0, 2)])
    stream.abort()
    del stream
    gc.collect()
    assert unraisable == [] and [p for p in tmp_path.rglob("*") if p.is_file()] == []


# open survivors, session 27


def test_the_writer_processs_encoders_are_fresh_interpreters_not_copies_of_it(tmp_path, monkeypatch):
    """launcher/writer/writer_process.py: the writer process runs threads (its pool's, pyarrow's) that a fork would
    copy half-alive, so its encoders are spawned, as the writer process itself is (launcher/writer/bgwriter.py): an
    encoder holds none of the state its parent made at run time. Set up in this process as in the writer process:
    the parent's import finder that refuses pandas, put in place before the encoders start, is not in theirs."""
    import sys

    from launcher.config import load_config

    wp = _writer_process_here(monkeypatch)
    plain = types.SimpleNamespace(**OmegaConf.to_container(load_config("tiny").output, resolve=True))
    wp._start_writer(str(tmp_path), plain, 2, os.getpid())
    try:
        assert type(sys.meta_path[0]).__name__ == "_WithoutPandas"  # the parent's, at run time
        ask = "[type(f).__name__ for f in __import__('sys').meta_path]"
        finders = [wp._OUT["encoders"].submit(eval, ask).result(timeout=60) for _ in range(4)]
        assert all("_WithoutPandas" not in f for f in finders), finders
    finally:
        wp._stop_encoders()


def _writer_process_here(monkeypatch):
    """launcher/writer/writer_process.py run in this process, standing for the writer process: its encoders get
    the real die_with_parent, this process is not reniced, and its import hooks and streams are put back after."""
    import sys

    from launcher.writer import writer_process as wp

    real = wp.die_with_parent

    def not_this_process(parent):
        monkeypatch.setattr(wp, "die_with_parent", real)

    monkeypatch.setattr(wp, "die_with_parent", not_this_process)
    monkeypatch.setattr(wp.os, "nice", lambda n: None)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(wp, "_OUT", {})
    return wp
