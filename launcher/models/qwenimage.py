"""Qwen-Image (`QwenImagePipeline`: Qwen2.5-VL text encoder, QwenImage MMDiT transformer, a Wan-style video VAE):
what the runner knows of it, and its tiny random-weight pipeline.

- Both parts have tensor-parallel plans (diffusers' on the transformer, transformers' on Qwen2.5-VL's text model).
- Guidance is "true CFG": the pipeline's `true_cfg_scale` is our `guidance_scale`, and it guides only when given a
  negative prompt, so a row without one gets " " (what the model card uses); its own `guidance_scale` is for
  guidance-distilled checkpoints only and is left out.
- The prompt is wrapped in a template with a system message; the pipeline drops the template's first
  `prompt_template_encode_start_idx` tokens, and `max_sequence_length` (at most 1024) applies to the rest.
- Its VAE downsamples by 2 per `temperal_downsample` entry (3 in the real one: scale factor 8).
"""

from __future__ import annotations

import os
from pathlib import Path

from launcher.models import Family


def tiny_text_encoder(tokenizer, vocab_size: int, vision_ids: list[int], max_positions: int):
    """The tiny Qwen2.5-VL of both tiny Qwen pipelines, seeded: `vision_ids` are the image, video, vision-start and
    vision-end token ids. 4 heads and 2 KV heads: tp=2 divides both. mrope_section sums to head_dim / 2."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    image, video, start, end = vision_ids
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max_positions,
            rope_scaling={"type": "mrope", "rope_type": "default", "mrope_section": [1, 1, 2]},
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.eos_token_id,  # the real one's too: no separate BOS
            eos_token_id=tokenizer.eos_token_id,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32),
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_tiny(out_dir: str | os.PathLike) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    from launcher.models._tiny import qwen_tokenizer, save_atomically

    tokenizer = qwen_tokenizer()
    n = len(tokenizer)  # the vision tokens take the ids after the tokenizer's (a prompt never contains them)
    text_encoder = tiny_text_encoder(tokenizer, n + 4, [n, n + 1, n + 2, n + 3], max_positions=2048)
    transformer, vae = tiny_transformer_and_vae()
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    return save_atomically(pipe, out_dir, "Qwen-Image")


def tiny_transformer_and_vae():
    """The tiny transformer and VAE, seeded after the text encoder (Qwen-Image and Qwen-Image-Edit-Plus share them)."""
    import torch
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    torch.manual_seed(1)
    # 2 heads: tp=2 divides them. in_channels = 4 latent channels x the pipeline's 2x2 packing.
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )
    torch.manual_seed(2)
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    return transformer, vae


def _token_ids(pipe, prompts: list[str]) -> list[list[int]]:
    drop = pipe.prompt_template_encode_start_idx
    ids = pipe.tokenizer([pipe.prompt_template_encode.format(p) for p in prompts])["input_ids"]
    return [i[drop:] for i in ids]


def _call_kwargs(kwargs: dict) -> dict:
    if "guidance_scale" in kwargs:
        kwargs["true_cfg_scale"] = kwargs.pop("guidance_scale")
    if kwargs.get("true_cfg_scale", 0) > 1 and "negative_prompt" not in kwargs:
        kwargs["negative_prompt"] = [" "] * len(kwargs["prompt"])
    elif "negative_prompt" in kwargs:
        kwargs["negative_prompt"] = [p or " " for p in kwargs["negative_prompt"]]
    return kwargs


FAMILY = Family(
    "qwenimage",
    pipelines=("QwenImagePipeline",),
    tp_transformer=True,
    repeated_blocks=True,
    uses_cfg=True,
    token_ids=_token_ids,
    call_kwargs=_call_kwargs,
    build_tiny=build_tiny,
    tp_text_encoder=True,
)
