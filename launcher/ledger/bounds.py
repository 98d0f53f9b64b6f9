"""The bounds of every generation value, per row and in the config: nothing that can exhaust a host.

Without them one row could stop a job for good: `num_inference_steps=1000000000` takes a worker to 22 GiB and
the kernel's OOM killer, and every rerun repeats it; `guidance_scale=inf` gives an all-black image that is
marked done; a 100 MB prompt is read whole by every rank that generates it, although the text encoder keeps only
its first `generate.max_sequence_length` tokens. So both prompt readers (launcher/ledger/prompts.py, exact, and
prompts_fast.py, vectorised) and the config check (launcher/host/checks.py) refuse them at planning, exit 2,
naming the file and the line or the key, and the bound.
"""

from __future__ import annotations

import math

STEPS = (1, 1000)  # num_inference_steps: distilled models use 1-8, base models 20-100
GUIDANCE = (0.0, 100.0)  # guidance_scale: models are trained for 1-10; past 100 only saturated images
TEXT_BYTES = 64 * 1024  # a prompt or a negative prompt, in UTF-8: some thousand tokens, more than any encoder keeps
SEQUENCE = (1, 4096)  # generate.max_sequence_length: the longest any supported text encoder takes is 1024
IMAGES_PER_PROMPT = (1, 10_000)


def steps_problem(value: int) -> str | None:
    low, high = STEPS
    return None if low <= value <= high else f"must be an integer from {low} to {high}"


def guidance_problem(value: float) -> str | None:
    low, high = GUIDANCE
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


def _within(value: int, bounds: tuple[int, int]) -> str | None:
    low, high = bounds
    return None if low <= value <= high else f"must be an integer from {low} to {high}"
