"""FLUX.2 [klein] (`Flux2KleinPipeline`: Qwen3 text encoder, Flux2 transformer): what the runner knows of it, and
its tiny random-weight pipeline.

- Both parts have tensor-parallel plans (diffusers' on the transformer, transformers' on Qwen3).
- The prompt goes through Qwen3's chat template (a user turn, then the assistant's opening with thinking turned
  off), which counts towards `max_sequence_length`; truncation counts tokenize it the same way.
- Guidance: a distilled checkpoint (`is_distilled`) ignores guidance_scale; the base one guides against an empty
  prompt of its own. The pipeline takes no negative prompt.
- `text_encoder_out_layers` must be a tuple (YAML gives a list); the real default is (9, 18, 27).
"""

from __future__ import annotations

import os
from pathlib import Path

from launcher.models import Family
from launcher.models.flux2 import _call_kwargs, tiny_vae

# Qwen3's template, reduced to what the pipeline sends: one user message, the generation prompt, no thinking.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def build_tiny(out_dir: str | os.PathLike) -> Path:
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from launcher.models._tiny import qwen_tokenizer, save_atomically

    tokenizer = qwen_tokenizer(CHAT_TEMPLATE)
    torch.manual_seed(0)
    # 4 heads, 2 KV heads: tp=2 divides both.
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    ).eval()
    torch.manual_seed(1)
    # joint_attention_dim = 2 encoder layers x hidden 32; run with text_encoder_out_layers=(1, 2).
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=64,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=False,
    )
    vae = tiny_vae()  # the same VAE as FLUX.2's
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,  # ty: ignore[invalid-argument-type]
        is_distilled=False,  # the base model: guidance_scale has an effect, so the tests can see it
    )
    return save_atomically(pipe, out_dir, "FLUX.2-klein")


def _token_ids(pipe, prompts: list[str]) -> list[list[int]]:
    texts = [
        pipe.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        for p in prompts
    ]
    return pipe.tokenizer(texts)["input_ids"]


FAMILY = Family(
    "flux2_klein",
    pipelines=("Flux2KleinPipeline",),
    tp_transformer=True,
    repeated_blocks=True,
    token_ids=_token_ids,
    call_kwargs=_call_kwargs,
    build_tiny=build_tiny,
    tp_text_encoder=True,
    max_references=4,  # Flux2KleinPipeline takes `image=` (a list) as FLUX.2 does; BFL documents up to 4
    row_fields=("seed", "height", "width", "num_inference_steps", "guidance_scale"),
    row_hint="FLUX.2 [klein] takes no negative prompt (its guidance is against an empty prompt, always); drop the "
    "column, or use a family that takes one: SD3, Qwen-Image, FLUX.1 with true_cfg_scale",
)
