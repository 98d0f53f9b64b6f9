"""The published component configs of the real checkpoints that conf/ names, for memory planning without weights.

Only architecture keys are kept (what decides the parameters); the memory planner instantiates each config on
the meta device and counts, so no total is typed by hand. A local folder or a cached snapshot is read instead
of this table. Sources, as stored copies of the hub's files and of diffusers' own conversion script:
- FLUX.2 transformers: diffusers scripts/convert_flux2_to_diffusers.py, get_flux2_transformer_config
  ("flux2-dev", "klein-4b"); they equal Flux2Transformer2DModel's defaults (dev) in diffusers 0.42.1.
- FLUX.2 VAE: the same script builds `AutoencoderKLFlux2()` with its defaults, so the published config is them.
- Mistral Small 3.1/3.2 24B (FLUX.2-dev's text encoder): huggingface.co/mistralai/
  Mistral-Small-3.1-24B-Instruct-2503/blob/main/config.json (3.2 has the same architecture).
- Qwen3-4B (FLUX.2-klein-4B's text encoder): Qwen/Qwen3-4B config.json, as mirrored at
  huggingface.co/MultiRL/qwen3_4b_instruct_sft/blob/main/config.json; also quoted by FLUX.2-klein ports.
- FLUX.1: transformer/config.json of black-forest-labs/FLUX.1-dev (guidance_embeds true) and -schnell (false),
  e.g. huggingface.co/mit-han-lab/svdq-int4-flux.1-schnell/blob/main/config.json; text_encoder_2/config.json
  (T5 v1.1 XXL) as snapshot-copied at huggingface.co/ostris/OpenFLUX.1 from FLUX.1-schnell; vae/config.json
  e.g. huggingface.co/PrunaAI/FLUX.1-schnell-smashed/blob/main/vae/config.json (snapshot of FLUX.1-schnell).
- SD3.5: transformer/config.json of stabilityai/stable-diffusion-3.5-medium (snapshot b940f670, copied at
  huggingface.co/Prgckwb/trpfrog-sd3.5-medium) and -large (huggingface.co/frankjoshua/stable-diffusion-3.5-large,
  "SD3.5 Large Public Release"); text_encoder and text_encoder_2 (CLIP-L, CLIP-G with projection) from the
  3.5-large/medium snapshots copied at huggingface.co/ariG23498/sd-3.5-merged and Kolyadual/MicroMacro-GenImage.
- Qwen-Image: transformer and vae are diffusers' QwenImageTransformer2DModel / AutoencoderKLQwenImage defaults;
  the text encoder is Qwen2.5-VL-7B-Instruct (huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct/blob/main/config.json;
  Qwen-Image's text_encoder/config.json, e.g. huggingface.co/hfpox/qfn, repeats it).
"""

from __future__ import annotations

Component = tuple[str, str, dict]  # (library, class name, config)

_FLUX2_DEV_TRANSFORMER = dict(
    patch_size=1,
    in_channels=128,
    num_layers=8,
    num_single_layers=48,
    attention_head_dim=128,
    num_attention_heads=48,
    joint_attention_dim=15360,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=[32, 32, 32, 32],
    rope_theta=2000,
    eps=1e-6,
)
_FLUX2_KLEIN_4B_TRANSFORMER = {
    **_FLUX2_DEV_TRANSFORMER,
    "num_layers": 5,
    "num_single_layers": 20,
    "num_attention_heads": 24,
    "joint_attention_dim": 7680,
    "guidance_embeds": False,
}
_MISTRAL_SMALL_3 = dict(
    model_type="mistral3",
    image_token_index=10,
    multimodal_projector_bias=False,
    projector_hidden_act="gelu",
    spatial_merge_size=2,
    text_config=dict(
        model_type="mistral",
        head_dim=128,
        hidden_size=5120,
        intermediate_size=32768,
        max_position_embeddings=131072,
        num_attention_heads=32,
        num_hidden_layers=40,
        num_key_value_heads=8,
        vocab_size=131072,
    ),
    vision_config=dict(
        model_type="pixtral",
        head_dim=64,
        hidden_size=1024,
        image_size=1540,
        intermediate_size=4096,
        num_attention_heads=16,
        num_hidden_layers=24,
        patch_size=14,
    ),
)
_QWEN3_4B = dict(
    model_type="qwen3",
    head_dim=128,
    hidden_size=2560,
    intermediate_size=9728,
    num_attention_heads=32,
    num_hidden_layers=36,
    num_key_value_heads=8,
    vocab_size=151936,
    tie_word_embeddings=True,
)
_FLUX1_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    axes_dims_rope=[16, 56, 56],
)
_CLIP_L = dict(
    model_type="clip_text_model",
    hidden_size=768,
    intermediate_size=3072,
    num_attention_heads=12,
    num_hidden_layers=12,
    max_position_embeddings=77,
    projection_dim=768,
    vocab_size=49408,
)
_CLIP_G = {**_CLIP_L, "hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 20}
_CLIP_G.update(num_hidden_layers=32, projection_dim=1280)
_T5_XXL = dict(
    model_type="t5",
    d_ff=10240,
    d_kv=64,
    d_model=4096,
    feed_forward_proj="gated-gelu",
    num_heads=64,
    num_layers=24,
    vocab_size=32128,
    tie_word_embeddings=False,
)
_KL16 = dict(  # FLUX.1's and SD3's 16-channel AutoencoderKL (same layers, other scaling factors)
    block_out_channels=[128, 256, 512, 512],
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    latent_channels=16,
    layers_per_block=2,
    norm_num_groups=32,
    sample_size=1024,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
_SD35_MEDIUM_TRANSFORMER = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=384,
    dual_attention_layers=list(range(13)),
    qk_norm="rms_norm",
)
_SD35_LARGE_TRANSFORMER = {
    **_SD35_MEDIUM_TRANSFORMER,
    "num_layers": 38,
    "num_attention_heads": 38,
    "caption_projection_dim": 2432,
    "pos_embed_max_size": 192,
    "dual_attention_layers": [],
}
_QWEN25_VL_7B = dict(
    model_type="qwen2_5_vl",
    text_config=dict(
        model_type="qwen2_5_vl_text",
        hidden_size=3584,
        intermediate_size=18944,
        num_attention_heads=28,
        num_hidden_layers=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    vision_config=dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=3584,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
    ),
    tie_word_embeddings=False,
)

_D, _T = "diffusers", "transformers"
# The class defaults (the published configs), spelt out where the size check reads them (its VAE's scale factor).
_FLUX2_VAE = {"block_out_channels": [128, 256, 512, 512]}
_FLUX1 = {
    "text_encoder": (_T, "CLIPTextModel", _CLIP_L),
    "text_encoder_2": (_T, "T5EncoderModel", _T5_XXL),
    "vae": (_D, "AutoencoderKL", _KL16),
}
_SD3 = {
    "text_encoder": (_T, "CLIPTextModelWithProjection", _CLIP_L),
    "text_encoder_2": (_T, "CLIPTextModelWithProjection", _CLIP_G),
    "text_encoder_3": (_T, "T5EncoderModel", _T5_XXL),
    "vae": (_D, "AutoencoderKL", _KL16),
}

# hub id -> component -> (library, class, config), the way model_index.json names them.
PUBLISHED: dict[str, dict[str, Component]] = {
    "black-forest-labs/FLUX.2-dev": {
        "transformer": (_D, "Flux2Transformer2DModel", _FLUX2_DEV_TRANSFORMER),
        "text_encoder": (_T, "Mistral3ForConditionalGeneration", _MISTRAL_SMALL_3),
        "vae": (_D, "AutoencoderKLFlux2", _FLUX2_VAE),
    },
    "black-forest-labs/FLUX.2-klein-4B": {
        "transformer": (_D, "Flux2Transformer2DModel", _FLUX2_KLEIN_4B_TRANSFORMER),
        "text_encoder": (_T, "Qwen3ForCausalLM", _QWEN3_4B),
        "vae": (_D, "AutoencoderKLFlux2", _FLUX2_VAE),
    },
    "black-forest-labs/FLUX.1-schnell": {
        "transformer": (_D, "FluxTransformer2DModel", {**_FLUX1_TRANSFORMER, "guidance_embeds": False}),
        **_FLUX1,
    },
    "black-forest-labs/FLUX.1-dev": {
        "transformer": (_D, "FluxTransformer2DModel", {**_FLUX1_TRANSFORMER, "guidance_embeds": True}),
        **_FLUX1,
    },
    "stabilityai/stable-diffusion-3.5-medium": {
        "transformer": (_D, "SD3Transformer2DModel", _SD35_MEDIUM_TRANSFORMER),
        **_SD3,
    },
    "stabilityai/stable-diffusion-3.5-large": {
        "transformer": (_D, "SD3Transformer2DModel", _SD35_LARGE_TRANSFORMER),
        **_SD3,
    },
    "Qwen/Qwen-Image": {
        "transformer": (_D, "QwenImageTransformer2DModel", {"patch_size": 2}),
        "text_encoder": (_T, "Qwen2_5_VLForConditionalGeneration", _QWEN25_VL_7B),
        "vae": (_D, "AutoencoderKLQwenImage", {"temperal_downsample": [False, True, True]}),
    },
}


def published(hub_id: str) -> dict[str, Component] | None:
    return PUBLISHED.get(hub_id)


# hub id -> its pipeline class (model_index.json's _class_name), which names its family (launcher/models/).
PIPELINES = {
    "black-forest-labs/FLUX.2-dev": "Flux2Pipeline",
    "black-forest-labs/FLUX.2-klein-4B": "Flux2KleinPipeline",
    "black-forest-labs/FLUX.1-schnell": "FluxPipeline",
    "black-forest-labs/FLUX.1-dev": "FluxPipeline",
    "stabilityai/stable-diffusion-3.5-medium": "StableDiffusion3Pipeline",
    "stabilityai/stable-diffusion-3.5-large": "StableDiffusion3Pipeline",
    "Qwen/Qwen-Image": "QwenImagePipeline",
}


def published_pipeline(hub_id: str) -> str:
    return PIPELINES.get(hub_id, "")


# hub id -> (GB the launcher downloads: the files the pipeline loads, gated). The sizes are the parameter counts of
# the configs above at the dtype the repos store (bfloat16 or float16: 2 bytes a parameter), tokenizers and configs
# left out: "about", good to a few percent. Gated: True where the repo asks an account to accept its license before
# any download (FLUX.1-dev's and FLUX.2-dev's non-commercial licenses, Stability's community license for SD3.5),
# False where it is open (Qwen-Image, Apache-2.0), None where this project has not checked.
DOWNLOADS: dict[str, tuple[float, bool | None]] = {
    "black-forest-labs/FLUX.2-dev": (111.3, True),
    "black-forest-labs/FLUX.2-klein-4B": (16.0, None),
    "black-forest-labs/FLUX.1-schnell": (33.7, None),
    "black-forest-labs/FLUX.1-dev": (33.7, True),
    "stabilityai/stable-diffusion-3.5-medium": (16.3, True),
    "stabilityai/stable-diffusion-3.5-large": (27.6, True),
    "Qwen/Qwen-Image": (57.7, False),
}
