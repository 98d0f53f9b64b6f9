"""Tiny random-weight quality models (launcher/worker/quality.py), built offline and deterministically like the
tiny pipelines: a CLIP model with its processor (the classes of `openai/clip-vit-large-patch14`) and diffusers'
safety checker with its image processor (the layout of `CompVis/stable-diffusion-safety-checker`)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from launcher.models._tiny import clip_tokenizer

IMAGE_SIZE = 32  # pixels the tiny models see (the real ones: 224)
THRESHOLD = 0.43  # random images score ~0.39-0.52 against the random concepts: some flagged, some not


def _configs():
    from transformers import CLIPConfig

    text = {"hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 4, "num_hidden_layers": 2}
    vision = {**text, "image_size": IMAGE_SIZE, "patch_size": 8, "num_channels": 3}
    # The real models' logit scale (ln 100), so logits_per_image is 100 * cosine as in CLIPScore.
    return CLIPConfig(
        text_config={**text, "vocab_size": 1024, "max_position_embeddings": 77, "bos_token_id": 0, "eos_token_id": 1},
        vision_config=vision,
        projection_dim=16,
        logit_scale_init_value=4.605170185988092,
    )


def _processor_kwargs() -> dict:
    return {"size": {"shortest_edge": IMAGE_SIZE}, "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}}


def build_tiny_clip(out_dir: str | Path) -> Path:
    import torch
    from transformers import CLIPImageProcessor, CLIPModel, CLIPProcessor

    torch.manual_seed(0)
    model = CLIPModel(_configs()).eval()
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(**_processor_kwargs()), tokenizer=clip_tokenizer())
    return _save(out_dir, model, processor)


def build_tiny_checker(out_dir: str | Path) -> Path:
    import torch
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPImageProcessor

    torch.manual_seed(1)
    checker = StableDiffusionSafetyChecker(_configs()).eval()
    with torch.no_grad():  # thresholds that flag some random images and pass others (the real ones: ~0.2)
        checker.concept_embeds.copy_(torch.randn_like(checker.concept_embeds))
        checker.special_care_embeds.copy_(torch.randn_like(checker.special_care_embeds))
        checker.concept_embeds_weights.fill_(THRESHOLD)
        checker.special_care_embeds_weights.fill_(1.0)  # no special care: its adjustment would blur the test
    return _save(out_dir, checker, CLIPImageProcessor(**_processor_kwargs()))


def _save(out_dir, model, processor) -> Path:
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    processor.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process built the same one first
        shutil.rmtree(tmp, ignore_errors=True)
    return out
