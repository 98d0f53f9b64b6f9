"""FLUX.1 (`FluxPipeline`: CLIP-L for the pooled vector, T5-XXL for the sequence, Flux transformer): what the runner
knows of it, and its tiny random-weight pipeline.

- The transformer has diffusers' tensor-parallel plan and repeated blocks (compile_repeated_blocks works, so the
  offload recipe can compile); neither text encoder has a transformers plan: they are replicated under tp.
- No classifier-free guidance (schnell is timestep-distilled, dev guidance-distilled): no negative prompt.
- `max_sequence_length` applies to T5 (CLIP always stops at 77); truncation counts use T5's tokenizer.
- The tiny pipeline is FLUX.1-schnell-shaped (no guidance embedding); every random draw is seeded.
"""

from __future__ import annotations

import os
from pathlib import Path

from launcher.models import Family


def clip_and_t5(clip_projection: bool = False, t5_dim: int = 32):
    """A tiny CLIP text model (hidden 32, 4 heads) and T5 encoder (4 heads), with their tokenizers; seeded."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from launcher.models._tiny import clip_tokenizer, t5_tokenizer

    clip_tok, t5_tok = clip_tokenizer(), t5_tokenizer()
    clip_config = CLIPTextConfig(
        vocab_size=len(clip_tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        projection_dim=32,
        max_position_embeddings=77,
        bos_token_id=clip_tok.bos_token_id,
        eos_token_id=clip_tok.eos_token_id,
        pad_token_id=clip_tok.pad_token_id,
    )
    clip = (CLIPTextModelWithProjection if clip_projection else CLIPTextModel)(clip_config).eval()
    t5_config = T5Config(
        vocab_size=len(t5_tok),
        d_model=t5_dim,
        d_ff=64,
        d_kv=8,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=t5_tok.pad_token_id,
        eos_token_id=t5_tok.eos_token_id,
        decoder_start_token_id=0,  # ty: ignore[unknown-argument]
    )
    t5 = T5EncoderModel(t5_config).eval()
    return clip, clip_tok, t5, t5_tok


def tiny_vae(latent_channels: int, **kwargs):
    """An AutoencoderKL with 4 blocks: scale factor 8, like the real ones."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(8, 8, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=latent_channels,
        norm_num_groups=4,
        layers_per_block=1,
        sample_size=64,
        mid_block_add_attention=False,
        **kwargs,
    )


def build_tiny(out_dir: str | os.PathLike) -> Path:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    from launcher.models._tiny import save_atomically

    torch.manual_seed(0)
    clip, clip_tok, t5, t5_tok = clip_and_t5()
    torch.manual_seed(1)
    # 2 heads: tp=2 divides them. in_channels = 4 latent channels x the pipeline's 2x2 packing.
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(2)
    vae = tiny_vae(4, shift_factor=0.1159, scaling_factor=0.3611, use_quant_conv=False, use_post_quant_conv=False)
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False),
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tok,
        text_encoder_2=t5,
        tokenizer_2=t5_tok,
        transformer=transformer,  # ty: ignore[invalid-argument-type]
    )
    return save_atomically(pipe, out_dir, "FLUX.1")


FAMILY = Family(
    "flux1",
    pipelines=("FluxPipeline",),
    tp_transformer=True,
    repeated_blocks=True,
    build_tiny=build_tiny,
    tp_text_encoder=False,
    true_cfg=True,  # FluxPipeline's true_cfg_scale: real CFG with a negative prompt, beside the distilled guidance
    row_hint="FLUX.1 uses a negative prompt only with true CFG: set model.call_kwargs.true_cfg_scale above 1 "
    "(e.g. 4.0) or generate.sweep.true_cfg_scale, or drop the column",
)
