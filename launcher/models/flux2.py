"""FLUX.2 (`Flux2Pipeline`: Mistral3 text encoder, Flux2 transformer): what the runner knows of it, and its tiny
random-weight pipeline.

- Both parts have tensor-parallel plans (diffusers' `_tp_plan` on the transformer, transformers' on Mistral).
- The prompt is wrapped in a chat template with a ~170-token system message, which counts towards
  `max_sequence_length`; truncation counts tokenize it the same way.
- `text_encoder_out_layers` must be a tuple (YAML gives a list).
- Step caches: TaylorSeer and MagCache work; the pipeline opens no cache context, so the runner opens "cond".
- The tiny pipeline: the real checkpoints cannot be downloaded here, so tests and the demo run on the same
  classes and loading path as FLUX.2-dev with layer sizes small enough for two CPU cores. Every random draw is
  seeded, so two builds give identical weights and hence identical images.
"""

from __future__ import annotations

import os
from pathlib import Path

from launcher.models import Family

# A fixed byte-level vocabulary (no merges) needs no training corpus, so the tokenizer is the same every time.
_SPECIAL = ["<pad>", "<s>", "</s>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]"]
_CHAT_TEMPLATE = (
    "<s>{% for m in messages %}{% set text = m['content'][0]['text'] %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% else %}[INST]{{ text }}[/INST]{% endif %}{% endfor %}"
)


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(_SPECIAL + sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(_SPECIAL)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", model_max_length=512
    )
    tok.chat_template = _CHAT_TEMPLATE
    return tok, len(vocab)


def tiny_vae():
    """FLUX.2's VAE at tiny size (4 blocks: scale factor 8, like the real one); FLUX.2-klein shares it."""
    import torch
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(2)
    return AutoencoderKLFlux2(
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
        sample_size=64,
        mid_block_add_attention=False,
    )


def build_tiny(out_dir: str | os.PathLike) -> Path:
    """Write the tiny pipeline to `out_dir` (atomically: a half-built folder never appears there)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from launcher.models._tiny import save_atomically

    tokenizer, vocab_size = _tokenizer()
    torch.manual_seed(0)
    # 4 heads, 2 KV heads: tp=2 divides both, like the real encoder's 32/8 at tp=8.
    te_config = Mistral3Config(
        text_config=dict(
            model_type="mistral",
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=512,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        vision_config=dict(
            model_type="pixtral",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=8,
            image_size=32,
            patch_size=16,
        ),
    )
    text_encoder = Mistral3ForConditionalGeneration(te_config).eval()
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
    )
    vae = tiny_vae()
    pipe = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,  # ty: ignore[invalid-argument-type]
    )
    return save_atomically(pipe, out_dir, "FLUX.2")


def _token_ids(pipe, prompts: list[str]) -> list[list[int]]:
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    return pipe.tokenizer.apply_chat_template(format_input(prompts), tokenize=True, return_dict=True)["input_ids"]


def _call_kwargs(kwargs: dict) -> dict:
    if "text_encoder_out_layers" in kwargs:
        kwargs["text_encoder_out_layers"] = tuple(kwargs["text_encoder_out_layers"])
    return kwargs


def _decode_latents(pipe, latents, height: int, width: int):
    """What Flux2Pipeline does after its denoising loop, for latents it returned with output_type="latent"."""
    import torch
    from diffusers.utils.torch_utils import get_module_execution_device

    grid = (height // (pipe.vae_scale_factor * 2), width // (pipe.vae_scale_factor * 2))
    ids = pipe._prepare_latent_ids(torch.empty(latents.shape[0], latents.shape[2], *grid)).to(latents.device)
    latents = pipe._unpack_latents_with_ids(latents, ids)
    bn = pipe.vae.bn
    mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps).to(
        latents.device, latents.dtype
    )
    latents = pipe._unpatchify_latents(latents * std + mean).to(get_module_execution_device(pipe.vae))
    image = pipe.vae.decode(latents, return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type="np")


def _encode(pipe, kwargs: dict) -> dict:
    args = {k: kwargs[k] for k in ("max_sequence_length", "text_encoder_out_layers") if k in kwargs}
    embeds, _ = pipe.encode_prompt(prompt=kwargs["prompt"], device=pipe._execution_device, **args)
    return {"prompt_embeds": embeds}


FAMILY = Family(
    "flux2",
    pipelines=("Flux2Pipeline",),
    tp_transformer=True,
    repeated_blocks=True,
    token_ids=_token_ids,
    call_kwargs=_call_kwargs,
    build_tiny=build_tiny,
    # FirstBlockCache raises a TypeError on its transformer in diffusers 0.42.1.
    caches=("taylorseer", "magcache"),
    cache_context="cond",  # Flux2Pipeline opens no cache context of its own
    decode_latents=_decode_latents,
    encode=_encode,
    tp_text_encoder=True,
    max_references=10,  # `image=` takes a list; BFL documents up to 10 references for FLUX.2 [dev]
    requires=("torchvision",),  # its tokenizer is a PixtralProcessor (transformers 5.23)
    row_fields=("seed", "height", "width", "num_inference_steps", "guidance_scale"),
    row_hint="FLUX.2 takes no negative prompt (guidance is distilled into the model); drop the column, or use a "
    "family that takes one: FLUX.1 with true_cfg_scale, SD3, Qwen-Image",
)
