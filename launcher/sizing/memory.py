"""Per-rank weight memory of a pipeline, from its component configs alone (no weights, no network).

Each model component is instantiated from its config on the meta device and its parameters counted, with the
ones its tensor-parallel plan shards (diffusers' `_tp_plan` of the transformer class, transformers' `tp_plan`
of the text encoder, which adds the language model's prefix to its config's `base_model_tp_plan`) counted
apart. The counts are cached on disk by class, config and library versions: importing diffusers and
transformers costs the launcher about 4 s, the counting itself 0.1-0.5 s for a 24-32B model.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import re
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from launcher.models.checkpoints import Component, published

logger = logging.getLogger(__name__)

GIB = 1024**3
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
COUNT_VERSION = 2  # bump when the counting rules change, so cached counts are not reused


@dataclass(frozen=True)
class Counts:
    total: int  # parameters (tied ones once) and saved buffers
    sharded: int  # of them, in layers the tensor-parallel plan splits over tp
    fp32_half: int  # kept in float32 when loading in float16 (`_keep_in_fp32_modules`, e.g. T5's wo)
    fp32_strict: int  # kept in float32 in float16 and bfloat16 (`_keep_in_fp32_modules_strict`)

    def rank_bytes(self, tp: int, dtype: str, shard: bool) -> int:
        """Bytes of these weights on one rank of a tp group (sharded layers split tp ways if `shard`)."""
        sharded = -(-self.sharded // tp) if shard and tp > 1 else self.sharded
        numel = self.total - self.sharded + sharded
        fp32 = self.fp32_strict + (self.fp32_half if dtype == "float16" else 0) if dtype != "float32" else 0
        return numel * BYTES[dtype] + fp32 * (4 - BYTES[dtype])


def components(path: str, root: Path | None) -> dict[str, Component] | None:
    """The pipeline's model components: from its folder's configs if there is one, else the published table."""
    if root is None:
        return published(path)
    try:
        index = json.loads((root / "model_index.json").read_text())
        out = {}
        for name, spec in index.items():
            config = root / name / "config.json"
            if isinstance(spec, list) and len(spec) == 2 and spec[0] and config.is_file():
                out[name] = (spec[0], spec[1], json.loads(config.read_text()))
    except (OSError, ValueError, AttributeError):
        return None  # not a pipeline folder, or broken configs: preflight's model checks say which, in one line
    return out


def bucket(name: str) -> str | None:
    """Which part of the `# mesh:` line a component counts towards."""
    if name.startswith("text_encoder"):
        return "text_encoder"
    return {"transformer": "transformer", "unet": "transformer", "vae": "vae"}.get(name)


def counts(component: Component) -> Counts:
    key = _key(component)
    cache = _read_cache()
    if key not in cache:
        cache = {**_read_cache(), key: list(_count(component).__dict__.values())}
        _write_cache(cache)
    return Counts(*cache[key])


def _count(component: Component) -> Counts:
    import torch

    library, class_name, config = component
    for name in ("diffusers", "transformers"):  # their warnings about config keys a class does not take
        logging.getLogger(name).setLevel(logging.ERROR)
    cls = getattr(importlib.import_module(library), class_name)
    with torch.device("meta"):
        if library == "diffusers":
            model = cls.from_config(config)
            plan = getattr(cls, "_tp_plan", None) or {}
        else:
            model = cls(cls.config_class.from_dict(dict(config)))
            plan = _transformers_plan(model)
    rules = [(re.compile(re.escape(p).replace(r"\*", r"\d+")), _style(s)) for p, s in plan.items()]
    keep_half = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    keep_strict = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    total = sharded = fp32_half = fp32_strict = 0
    for module in model.modules():  # buffers that are saved take memory too (BatchNorm statistics)
        total += sum(
            b.numel()
            for n, b in module._buffers.items()
            if b is not None and n not in module._non_persistent_buffers_set
        )
    for name, p in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        n = p.numel()
        total += n
        style = next((s for rx, s in rules if rx.fullmatch(module)), None)
        if style == "all" or (style == "weight" and leaf == "weight"):
            sharded += n
        parts = set(module.split("."))
        fp32_strict += n if parts & keep_strict else 0
        fp32_half += n if parts & keep_half and not parts & keep_strict else 0
    return Counts(total, sharded, fp32_half, fp32_strict)


def _transformers_plan(model) -> dict:
    """The plan transformers applies: none unless the text config has one (T5, CLIP: none)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(config, "base_model_tp_plan", None):
        return {}
    return dict(getattr(model, "tp_plan", None) or {})


def _style(style) -> str | None:
    """What a plan entry splits: "all" (column-wise and embeddings: weight and bias), "weight" (row-wise: the
    bias is added after the reduction, so it stays whole), None (replicated)."""
    s = (style if isinstance(style, str) else type(style).__name__).lower()
    if "replicate" in s:
        return None
    if "rowwise" in s and "embedding" not in s:
        return "weight"
    return "all" if "colwise" in s or "embedding" in s else None


def _key(component: Component) -> str:
    library, class_name, config = component
    config = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("architectures", "torch_dtype")}
    blob = json.dumps(
        [COUNT_VERSION, library, class_name, config, version("diffusers"), version("transformers")],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def cache_path() -> Path:
    root = os.environ.get("MESHGEN_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "meshgen"
    return Path(root).expanduser() / "param_counts.json"


def _read_cache() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(cache: dict) -> None:
    from launcher.hashes import write_cache_file

    write_cache_file(cache_path(), cache, "parameter counts")


# quality.*: the scoring models each writing rank holds beside the pipeline (launcher/worker/quality.py), counted
# from their configs: a local folder's config.json, or, for the defaults, their published configs (CLIP ViT-L/14).
_VIT_L14 = {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24}
_VIT_L14 |= {"patch_size": 14, "image_size": 224}
_CLIP_TEXT = {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12, "num_hidden_layers": 12}
_CLIP_TEXT |= {"vocab_size": 49408, "max_position_embeddings": 77}
PUBLISHED_QUALITY = {
    "openai/clip-vit-large-patch14": {"vision_config": _VIT_L14, "text_config": _CLIP_TEXT, "projection_dim": 768},
    "CompVis/stable-diffusion-safety-checker": {"vision_config": _VIT_L14, "projection_dim": 768},
}
QUALITY_MODELS = {  # quality key -> (library, class, the key naming its model)
    "clip_score": ("transformers", "CLIPModel", "clip_model"),
    "safety": ("diffusers.pipelines.stable_diffusion.safety_checker", "StableDiffusionSafetyChecker", "safety_model"),
}


def quality_bytes(cfg) -> int:
    """Bytes of the quality models on a writing rank (replicated: not sharded over tp), in model.dtype."""
    q, total = cfg.get("quality"), 0
    for key, (library, class_name, model_key) in QUALITY_MODELS.items():
        if not (q and q.get(key)):
            continue
        config = quality_config(str(q[model_key]))
        if config is not None:
            total += counts((library, class_name, config)).rank_bytes(1, cfg.model.dtype, False)
    return total


def quality_config(path: str) -> dict | None:
    """A quality model's config: its folder's, or the published one of a default; None (not counted) otherwise."""
    local = Path(path).expanduser() / "config.json"
    try:
        return json.loads(local.read_text()) if local.is_file() else PUBLISHED_QUALITY.get(path)
    except (OSError, ValueError):
        return None
