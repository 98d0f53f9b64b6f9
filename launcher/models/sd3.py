"""Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline`: CLIP-L and CLIP-G with projection, T5-XXL, MMDiT
transformer): what the runner knows of it, and its tiny random-weight pipeline.

- No tensor-parallel plan (neither diffusers' for SD3Transformer2DModel nor transformers' for CLIP or T5): it
  runs as dp replicas with tp=1, and preflight refuses mesh.tp > 1.
- Its transformer defines no `_repeated_blocks`, so `compile_repeated_blocks` (the compile used under model
  offload) raises: preflight refuses compile + offload; compiling the whole transformer works.
- Classifier-free guidance: negative prompts and guidance_scale matter.
- `max_sequence_length` applies to T5 (the CLIPs always stop at 77); truncation counts use T5's tokenizer.
- The tiny pipeline is SD3.5-shaped (a dual-attention layer, RMS q/k norm, patch size 2); every draw is seeded.
"""

from __future__ import annotations

import os
from pathlib import Path

from launcher.models import Family


def build_tiny(out_dir: str | os.PathLike) -> Path:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    from launcher.models._tiny import clip_tokenizer, save_atomically
    from launcher.models.flux1 import clip_and_t5, tiny_vae

    # T5's width 64 holds both CLIPs' hidden states side by side (the pipeline pads them to T5's width).
    torch.manual_seed(0)
    clip_l, clip_tok, t5, t5_tok = clip_and_t5(clip_projection=True, t5_dim=64)
    torch.manual_seed(3)
    clip_g, _, _, _ = clip_and_t5(clip_projection=True)
    torch.manual_seed(1)
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=64,
        caption_projection_dim=32,
        pooled_projection_dim=64,  # the two CLIPs' 32-wide projections, concatenated
        pos_embed_max_size=32,  # up to 512x512 images
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    )
    torch.manual_seed(2)
    vae = tiny_vae(4, shift_factor=0.0609, scaling_factor=1.5305, use_quant_conv=False, use_post_quant_conv=False)
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=clip_l,
        tokenizer=clip_tok,
        text_encoder_2=clip_g,
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=t5,
        tokenizer_3=t5_tok,
        transformer=transformer,  # ty: ignore[invalid-argument-type]
    )
    return save_atomically(pipe, out_dir, "SD3")


FAMILY = Family(
    "sd3",
    pipelines=("StableDiffusion3Pipeline",),
    tp_transformer=False,
    repeated_blocks=False,
    uses_cfg=True,
    build_tiny=build_tiny,
    tp_text_encoder=False,
)
