"""Quality columns, scored on the chip as the images are made: `clip_score` and `nsfw` (the `quality.*` keys).

- `clip_score` (float32): 100 * the cosine of a CLIP model's image and text embeddings of the sample's image and
  prompt, as torchmetrics' CLIPScore computes it per sample (torchmetrics then clamps its mean at 0; we keep each
  sample's value, negative or not, so that a filter sees it). Prompts longer than CLIP's 77 tokens are cut.
- `nsfw` (bool): diffusers' StableDiffusionSafetyChecker, the Stable Diffusion pipelines' own check.

Both run on the rank that holds the images for the writer (tp rank 0 of each dp group: every tp rank has the
decoded images, but only that one hands them over), in the run's dtype, a model copy per such rank: CLIP ViT-L/14
is 0.43 B parameters (0.86 GB in bfloat16) and the checker 0.30 B, against FLUX.2-dev's ~30 B per replica, so
sharding them over tp would save little and cost a collective per call. They change no image, so they are not
part of the images' fingerprint; `python -m tools.score OUTPUT_DIR` adds them to a finished folder.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class Scorer:
    """The quality models of one process; `columns` scores a batch of images and their prompts."""

    def __init__(self, qcfg, device: str | torch.device = "cpu", dtype: str = "float32"):
        from transformers import CLIPImageProcessor

        self.device, self.dtype, self.batch_size = torch.device(device), DTYPES[dtype], int(qcfg.batch_size)
        self.clip = self.checker = None
        if qcfg.clip_score:
            from transformers import CLIPModel, CLIPProcessor

            self.clip = CLIPModel.from_pretrained(qcfg.clip_model, dtype=self.dtype).to(self.device).eval()
            self.processor = CLIPProcessor.from_pretrained(qcfg.clip_model)
        if qcfg.safety:
            from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker

            # It would say "a black image will be returned" of images it never touches: we give it stand-ins.
            logging.getLogger("diffusers.pipelines.stable_diffusion.safety_checker").setLevel(logging.ERROR)
            path = qcfg.safety_model
            self.checker = StableDiffusionSafetyChecker.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
            self.features = _checker_processor(path, CLIPImageProcessor)

    @property
    def names(self) -> list[str]:
        return ["clip_score"] * (self.clip is not None) + ["nsfw"] * (self.checker is not None)

    @staticmethod
    def names_for(qcfg) -> list[str]:
        """The columns a scorer of `qcfg` adds."""
        return ["clip_score"] * bool(qcfg.clip_score) + ["nsfw"] * bool(qcfg.safety)

    @torch.inference_mode()
    def columns(self, images: list[np.ndarray], prompts: list[str]) -> dict[str, list]:
        """{column: one value per image}: uint8 HxWx3 images and the prompts they were made from."""
        out: dict[str, list] = {n: [] for n in self.names}
        for i in range(0, len(images), self.batch_size):
            part, texts, pixels = images[i : i + self.batch_size], prompts[i : i + self.batch_size], None
            if self.clip is not None:
                scores, pixels = self.clip_scores(part, texts)
                out["clip_score"] += scores.tolist()
            if self.checker is not None:
                out["nsfw"] += self.nsfw(part, pixels if self._same_preprocessing else None)
        return out

    @property
    def _same_preprocessing(self) -> bool:
        """The checker sees what CLIP saw (both CLIP's 224-pixel preprocessing, the defaults' case): the resize of
        a 1024-pixel image on the CPU, ~20 ms, is then paid once."""
        if not hasattr(self, "_same"):
            ours = self.processor.image_processor.to_dict() if self.clip is not None else None
            theirs = self.features.to_dict() if self.checker is not None else None
            drop = ("image_processor_type", "processor_class")
            self._same = ours is not None and {k: v for k, v in ours.items() if k not in drop} == {
                k: v for k, v in (theirs or {}).items() if k not in drop
            }
        return self._same

    def clip_scores(self, images: list[np.ndarray], prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The scores, and the preprocessed images (pixel_values)."""
        inputs = self.processor(text=prompts, images=images, return_tensors="pt", padding=True, truncation=True)
        scores = self.clip_scores_of(inputs["pixel_values"], inputs["input_ids"], inputs["attention_mask"])
        return scores, inputs["pixel_values"]

    def clip_scores_of(self, pixel_values, input_ids, attention_mask) -> torch.Tensor:
        """100 * cosine(image embedding, text embedding), row by row, as float32 on the CPU."""
        image = self.clip.get_image_features(pixel_values=pixel_values.to(self.device, self.dtype))
        text = self.clip.get_text_features(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device)
        )
        image, text = _embeds(image), _embeds(text)
        cos = torch.nn.functional.cosine_similarity(image.float(), text.float(), dim=-1)
        return (100 * cos).cpu()

    def nsfw(self, images: list[np.ndarray], pixel_values=None) -> list[bool]:
        if pixel_values is None:
            pixel_values = self.features(images, return_tensors="pt").pixel_values
        clip_input = pixel_values.to(self.device, self.dtype)
        # The checker blacks out what it flags in the images it is given: give it stand-ins, never ours.
        stand_ins = np.zeros((len(images), 1, 1, 3), np.float32)
        _, flagged = self.checker(images=stand_ins, clip_input=clip_input)
        return [bool(f) for f in flagged]

    def add_columns(self, samples: list[dict]) -> None:
        """The worker's hook: each sample (with `pixels` and `prompt`) gains the quality columns, in place."""
        if not samples:
            return
        cols = self.columns([s["pixels"] for s in samples], [s["prompt"] for s in samples])
        for name, values in cols.items():
            for s, v in zip(samples, values, strict=True):
                s[name] = v


def _embeds(x):
    """transformers 5 returns an output object from get_*_features; older ones, the tensor."""
    return x if isinstance(x, torch.Tensor) else x.pooler_output


def _checker_processor(path: str, cls):
    """The checker's image processor: its repo's own (preprocessor_config.json beside the weights, or a
    pipeline's feature_extractor/), else CLIP's standard 224 preprocessing."""
    for sub in (None, "feature_extractor"):
        try:
            return cls.from_pretrained(path, subfolder=sub) if sub else cls.from_pretrained(path)
        except (OSError, ValueError):
            continue
    return cls(crop_size=224, size={"shortest_edge": 224})


def enabled(cfg) -> bool:
    q = cfg.get("quality")
    return bool(q and (q.clip_score or q.safety))


def load_scorer(cfg, device) -> Scorer | None:
    """The worker's scorer, or None when no quality column is asked for."""
    if not enabled(cfg):
        return None
    return Scorer(cfg.quality, device, cfg.model.dtype)
