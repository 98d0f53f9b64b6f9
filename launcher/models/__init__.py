"""What the runner must know of each model family, one module per family (the family's plan as data).

Generic code asks `family_of(...)` instead of testing class names: which pipelines a family covers, how its
latents are patchified (the size multiple), what it supports (a tensor-parallel plan, repeated blocks, CFG),
its call's quirks, how its pipeline tokenizes a prompt (for truncation counts), and how to build its tiny
random-weight pipeline for tests. A pipeline no module claims gets the generic defaults below.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FAMILY_MODULES = (
    "flux2",
    "flux1",
    "sd3",
    "qwenimage",
    "flux2_klein",
    "qwenimage_edit",
)  # launcher/models/<name>.py, each defining FAMILY


def _last_tokenizer_ids(pipe, prompts: list[str]) -> list[list[int]] | None:
    """Token ids as the pipeline's last tokenizer sees them: max_sequence_length applies to it (T5 beside CLIP,
    whose tokenizers always stop at 77)."""
    names = ("tokenizer_3", "tokenizer_2", "tokenizer")
    tokenizer = next((t for t in (getattr(pipe, n, None) for n in names) if t is not None), None)
    return None if tokenizer is None else tokenizer(prompts)["input_ids"]


# The prompt source's per-row columns (launcher/sources/prompts.py's OVERRIDE_COLUMNS), each a pipeline argument:
# `seed` is the generator's, the others are the arguments of the same names.
ROW_FIELDS = ("seed", "height", "width", "negative_prompt", "num_inference_steps", "guidance_scale")


@dataclass(frozen=True)
class Family:
    name: str
    pipelines: tuple[str, ...] = ()  # diffusers pipeline class names (model_index.json's _class_name)
    latent_patch: int = 2  # latents are patchified 2x2 (by the transformer or by the pipeline's packing)
    tp_transformer: bool = False  # diffusers has a tensor-parallel plan for its transformer
    repeated_blocks: bool = False  # its transformer defines _repeated_blocks (compile_repeated_blocks works)
    uses_cfg: bool = False  # classifier-free guidance: negative prompts matter
    true_cfg: bool = False  # its pipeline takes a true_cfg_scale apart from guidance_scale (a sweep may set it)
    # (pipe, prompts) -> token ids as the pipeline encodes them, or None; the tokenizer's max length is lifted
    token_ids: Callable = _last_tokenizer_ids
    call_kwargs: Callable[[dict], dict] = lambda kwargs: kwargs  # the call's quirks, applied to its kwargs
    build_tiny: Callable | None = None  # (out_dir) -> Path: its tiny random-weight pipeline
    # Step caches (execution.cache) known to work on its transformer; none unless declared.
    caches: tuple[str, ...] = ()
    cache_context: str | None = None  # the context the runner opens around each call, where the pipeline opens none
    # (pipe, latents of output_type="latent", height, width) -> images as numpy in [0, 1], as output_type="np"
    # gives them: staged execution decodes a shard's latents in one pass of the VAE. None: the pipeline decodes.
    decode_latents: Callable | None = None
    # (pipe, call kwargs) -> the embedding kwargs that replace the prompt in a call; None: no staged execution.
    encode: Callable | None = None
    # What a job may ask of it, checked at preflight (issue 15):
    tp_text_encoder: bool = False  # transformers has a tensor-parallel plan for its (first) text encoder
    max_pixels: int = 4 * 1024 * 1024  # the largest height x width a row may ask for
    # job=edit: how many reference images its pipeline's `image=` takes per call (0: it does not edit), and the
    # pipeline classes that edit where they differ from the text-to-image ones (model_index.json names one).
    max_references: int = 0
    # packages beyond the base dependencies that its real checkpoint needs to load (in the cuda and tpu extras)
    requires: tuple[str, ...] = ()
    # The row columns its pipeline's __call__ takes (tests/test_integrity_values.py holds them to the signature): a
    # column outside them is refused at planning with `row_hint`, else the data would record what no image saw.
    row_fields: tuple[str, ...] = ROW_FIELDS
    row_hint: str = ""  # why such a column is ignored and what to do instead, in this family's words

    def ignored_columns(self, true_cfg_scales: list[float]) -> dict[str, str]:
        """column -> why this family's pipeline would not see it. `true_cfg_scales`: the values of true_cfg_scale
        the run calls the pipeline with ([] where none is set); a true-CFG family (`true_cfg`) uses a negative
        prompt only where it is above 1, as FluxPipeline does."""
        out = {c: self.row_hint for c in ROW_FIELDS if c not in self.row_fields}
        if self.true_cfg and "negative_prompt" in self.row_fields and not any(s > 1 for s in true_cfg_scales):
            out["negative_prompt"] = self.row_hint
        return out


GENERIC = Family("generic")


def families() -> list[Family]:
    return [importlib.import_module(f"launcher.models.{m}").FAMILY for m in FAMILY_MODULES]


def family_of(pipeline_class: str) -> Family:
    return next((f for f in families() if pipeline_class in f.pipelines), GENERIC)


def pipeline_class(root: Path) -> str:
    """The pipeline class name of a folder, from its model_index.json ("" if unreadable)."""
    try:
        return json.loads((Path(root) / "model_index.json").read_text()).get("_class_name", "")
    except (OSError, ValueError):
        return ""


def family_of_folder(root: Path) -> Family:
    """The family of a pipeline folder, from its model_index.json (no weights read)."""
    return family_of(pipeline_class(root))


def builders() -> dict[str, Family]:
    """`model.build` names: tiny_<family> for each family that can build its tiny pipeline."""
    return {f"tiny_{f.name}": f for f in families() if f.build_tiny}


def default_dir(build_name: str) -> Path:
    """Where a tiny model's conf puts it (`tiny_flux2` -> models/tiny-flux2 in the checkout): the only place a
    missing model is built on first use."""
    from launcher.config import REPO_ROOT

    return REPO_ROOT / "models" / build_name.replace("_", "-")


def build(name: str, out_dir) -> Path:
    from launcher.errors import ConfigError

    fam = builders().get(name)
    if fam is None:
        raise ConfigError(f"model.build={name!r} is unknown; builders: {', '.join(sorted(builders()))}")
    return fam.build_tiny(out_dir)
