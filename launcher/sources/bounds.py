"""The bounds of every generation value, whichever path brings it to the pipeline: the config, a row, a sweep,
`model.call_kwargs`. One set, here, so no path is looser than another.

Without them one value could stop a job for good: `num_inference_steps=1000000000` takes a worker to 22 GiB and
the kernel's OOM killer, and every rerun repeats it; `guidance_scale=inf` gives an all-black image that is
marked done; a 100 MB prompt is read whole by every rank that generates it, although the text encoder keeps only
its first `generate.max_sequence_length` tokens. So both prompt readers (launcher/sources/prompts.py, exact, and
prompts_fast.py, vectorised), the sweep's check (launcher/plan/sweep.py) and the config check
(launcher/checks/settings.py) refuse them at planning, exit 2, naming the file and the line or the key, and the bound.
"""

from __future__ import annotations

import math

STEPS = (1, 1000)  # num_inference_steps: distilled models use 1-8, base models 20-100
GUIDANCE = (0.0, 100.0)  # guidance_scale: models are trained for 1-10; past 100 only saturated images
TEXT_BYTES = 64 * 1024  # a prompt or a negative prompt, in UTF-8: some thousand tokens, more than any encoder keeps
SEQUENCE = (1, 4096)  # generate.max_sequence_length: the longest any supported text encoder takes is 1024
IMAGES_PER_PROMPT = (1, 10_000)
LORA_SCALE = (-100.0, 100.0)  # model.loras[i].scale: 0-2 in practice, negative to subtract a style
# The numbers a sweep or `model.call_kwargs` may set, by key: the same bounds as the config's and the rows'.
NUMBERS = {
    "num_inference_steps": STEPS,
    "guidance_scale": GUIDANCE,
    "true_cfg_scale": GUIDANCE,
    "skip_layer_guidance_scale": GUIDANCE,  # SD3's skip-layer guidance
    "caption_upsample_temperature": (0.0, 10.0),  # FLUX.2's prompt upsampling: a sampling temperature
}
# Pipeline arguments that a setting of meshgen's own fills (it checks, records and varies them per row):
# `model.call_kwargs` may not set them, or the record would say one value and the pipeline see another.
OWN_SETTING = {
    "prompt": "the prompt source (dataset.path, dataset.prompt_column)",
    "height": "generate.height",
    "width": "generate.width",
    "num_inference_steps": "generate.num_inference_steps",
    "sigmas": "generate.num_inference_steps",  # a schedule sets the number of steps
    "guidance_scale": "generate.guidance_scale",
    "max_sequence_length": "generate.max_sequence_length",
    "negative_prompt": "a negative_prompt column in the prompt source",
    "num_images_per_prompt": "generate.images_per_prompt",
    "generator": "generate.seed (or a seed column)",
    "latents": "generate.seed (or a seed column)",
    "image": "job=edit with dataset.image_column",
    "output_type": "output.format",
    "return_dict": "output.format",
}
# The other encoders' texts and the embeddings: the pipeline derives them from the row's prompt.
OWN_SETTING |= dict.fromkeys(
    ("prompt_2", "prompt_3", "negative_prompt_2", "negative_prompt_3"),
    "the prompt source (the pipeline gives every text encoder the row's prompt)",
)
OWN_SETTING |= dict.fromkeys(
    ("prompt_embeds", "pooled_prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds"),
    "the prompt source (the runner encodes the prompts)",
)


def steps_problem(value: int) -> str | None:
    low, high = STEPS
    return None if low <= value <= high else f"must be an integer from {low} to {high}"


def guidance_problem(value: float) -> str | None:
    return _number_problem(value, GUIDANCE)


def number_problem(key: str, value) -> str | None:
    """Why a number for `key` (a sweep's or a call's) is out of bounds: not finite, or beyond NUMBERS[key]."""
    return _number_problem(float(value), NUMBERS.get(key))


def _number_problem(value: float, bounds: tuple[float, float] | None) -> str | None:
    if bounds is None:
        return None if math.isfinite(value) else "must be a finite number"
    low, high = bounds
    ok = math.isfinite(value) and low <= value <= high
    return None if ok else f"must be a finite number from {low:g} to {high:g}"


def text_problem(what: str, text: str) -> str | None:
    """A one-line reason when `text` is longer than TEXT_BYTES of UTF-8 (counted without encoding long text twice)."""
    if len(text) * 4 <= TEXT_BYTES:  # a character is at most 4 bytes: certainly short enough
        return None
    n = len(text.encode("utf-8", "surrogatepass"))
    if n <= TEXT_BYTES:
        return None
    return (
        f"{what} is {n} bytes of UTF-8, more than the {TEXT_BYTES} (64 KiB) a prompt may hold; shorten it: "
        "the text encoder reads only its first generate.max_sequence_length tokens anyway"
    )


def config_problems(g) -> list[str]:
    """The `generate.*` settings outside their bounds, as `key=value must ...` (empty when all are within)."""
    out = []
    for key, value, why in (
        ("num_inference_steps", g.num_inference_steps, steps_problem(g.num_inference_steps)),
        ("guidance_scale", g.guidance_scale, guidance_problem(float(g.guidance_scale))),
        ("max_sequence_length", g.max_sequence_length, _within(g.max_sequence_length, SEQUENCE)),
        ("images_per_prompt", g.images_per_prompt, _within(g.images_per_prompt, IMAGES_PER_PROMPT)),
    ):
        if why:
            out.append(f"generate.{key}={value} {why}")
    return out


def call_kwargs_problem(kwargs: dict, swept=()) -> str | None:
    """The first `model.call_kwargs` entry that would reach the pipeline unchecked, as one line; None if none.

    `swept`: the keys `generate.sweep` sets (a call kwarg beside them would be overridden per variant)."""
    for key, value in kwargs.items():
        where = f"model.call_kwargs.{key}"
        if key in OWN_SETTING:
            return f"{where}: use {OWN_SETTING[key]}; a call kwarg would bypass its checks and its record"
        if key in swept:
            return f"{where}: generate.sweep.{key} sets it; drop one of the two"
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str):
                if why := text_problem(where, v):
                    return why
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                if why := number_problem(key, v):
                    return f"{where}={value} {why}"
            elif v is not None and not isinstance(v, bool):
                return (
                    f"{where}={value!r} is not a plain value; give text, a number, true/false or a list of those "
                    "(the record must hold what the pipeline is called with)"
                )
    return None


def _within(value: int, bounds: tuple[int, int]) -> str | None:
    low, high = bounds
    return None if low <= value <= high else f"must be an integer from {low} to {high}"
