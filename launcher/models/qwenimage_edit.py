"""Qwen-Image-Edit-Plus (`QwenImageEditPlusPipeline`): Qwen-Image's transformer and VAE, with a Qwen2.5-VL
processor that shows the text encoder the reference images; what the runner knows of it, and its tiny pipeline.

- It edits (`job=edit`): `image=` takes a list; the model card documents 1 to 3 references.
- One prompt per call (the pipeline refuses more); the edit job calls it so. It does not cut prompts at
  `max_sequence_length`, so no prompt counts as truncated.
- Guidance, tensor-parallel plans and the prompt template's dropped tokens are Qwen-Image's
  (launcher/models/qwenimage.py). The pipeline resizes each reference to 384x384 pixels' area for the text
  encoder and 1024x1024 for the VAE, whatever the output size.
- The tiny pipeline: Qwen-Image's tiny transformer and VAE, a tiny Qwen2.5-VL, and a processor made offline
  from the byte-level tokenizer (with Qwen's vision tokens) and Qwen2-VL's image processor.
"""

from __future__ import annotations

import os
from pathlib import Path

from launcher.models import Family
from launcher.models.qwenimage import _call_kwargs, tiny_text_encoder, tiny_transformer_and_vae

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build_tiny(out_dir: str | os.PathLike) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline
    from transformers import Qwen2VLImageProcessorPil

    from launcher.models._qwen_vl_processor import ImageOnlyQwenVLProcessor
    from launcher.models._tiny import QWEN_SPECIAL, qwen_tokenizer, save_atomically

    tokenizer = qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL[1:] + VISION_TOKENS})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    processor = ImageOnlyQwenVLProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer)
    vision_ids = [ids[t] for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")]
    text_encoder = tiny_text_encoder(tokenizer, len(tokenizer), vision_ids, max_positions=4096)
    transformer, vae = tiny_transformer_and_vae()
    pipe = QwenImageEditPlusPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=processor,  # ty: ignore[invalid-argument-type]
        transformer=transformer,
    )
    return save_atomically(pipe, out_dir, "Qwen-Image-Edit-Plus")


FAMILY = Family(
    "qwenimage_edit",
    pipelines=("QwenImageEditPlusPipeline",),
    tp_transformer=True,
    repeated_blocks=True,
    uses_cfg=True,
    token_ids=lambda pipe, prompts: None,  # its encode_prompt cuts nothing at max_sequence_length: none truncated
    call_kwargs=_call_kwargs,
    build_tiny=build_tiny,
    tp_text_encoder=True,
    max_references=3,
)
