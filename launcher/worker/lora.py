"""LoRAs (`model.loras`) fused into each rank's own tensor-parallel slice of the weights, at load.

Reading is diffusers' and PEFT's own: `<Pipeline>.lora_state_dict` converts the file's format (diffusers/PEFT keys,
kohya and the others it knows), and the component's own loader (`load_lora_adapter`, or the text-encoder loader)
injects PEFT layers into a copy of the component built on the meta device, which costs no weights. From those
layers we take each module's factors A (r x in), B (out x r) and PEFT's scaling (alpha / r, patterns, rsLoRA).

Fusing is ours, because diffusers refuses LoRA on a sharded model and its fuse would need the full weight:
for a column-wise sharded linear this rank adds B[rows] @ A, for a row-wise one B @ A[:, cols], with rows and
cols cut exactly as the load cut the weight (diffusers' own block arithmetic, so packed layers split per block).
The delta is computed as PEFT's `get_delta_weight` computes it (fp32 on CPU for half types), so at tp=1 the
weights are bitwise those of `load_lora_weights` + `fuse_lora`. The result is a plain model: no adapter layers.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


class LoraError(ValueError):
    """A LoRA that cannot be applied to this model (the launcher turns it into one line, exit 2)."""


@dataclass(frozen=True)
class Factor:
    """One module's LoRA: delta = scaling * B @ A (transposed where the layer stores W as in x out)."""

    A: torch.Tensor  # r x in
    B: torch.Tensor  # out x r
    scaling: float
    fan_in_fan_out: bool = False


Factors = dict[str, dict[str, Factor]]  # component -> module name -> factor


def loader_class(pipeline_class: str):
    """The diffusers pipeline class, if it has a LoRA loader (`lora_state_dict`); else None."""
    import diffusers

    cls = getattr(diffusers, pipeline_class, None)
    return cls if cls is not None and hasattr(cls, "lora_state_dict") else None


def read_state_dict(pipeline_class: str, file: Path) -> tuple[dict, dict | None, dict | None]:
    """(state dict with component prefixes, network alphas, metadata) as the pipeline's loader reads them."""
    import inspect

    cls = loader_class(pipeline_class)
    if cls is None:
        raise LoraError(f"diffusers has no LoRA loader for {pipeline_class}")
    kwargs = {"return_lora_metadata": True}
    with_alphas = "return_alphas" in inspect.signature(cls.lora_state_dict).parameters
    if with_alphas:
        kwargs["return_alphas"] = True
    out = cls.lora_state_dict(str(file), **kwargs)
    if with_alphas:
        state_dict, alphas, metadata = out
    else:
        (state_dict, metadata), alphas = out, None
    return state_dict, alphas or None, metadata


def components_in(state_dict: dict) -> list[str]:
    """The components a state dict has keys for (`transformer`, `text_encoder`, ...), in first-seen order."""
    return list(dict.fromkeys(k.split(".", 1)[0] for k in state_dict if "." in k))


@contextlib.contextmanager
def _adapters_stay_put():
    """PEFT moves new adapter weights to the base layer's device, which on a meta skeleton is meta: keep them."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    saved = BaseTunerLayer._move_adapter_to_device_of_base_layer
    BaseTunerLayer._move_adapter_to_device_of_base_layer = lambda self, *a, **k: None
    try:
        yield
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = saved


def factors(pipeline_class: str, file: Path, path: str) -> Factors:
    """Each module's factors, read by diffusers' loaders into meta-device copies of the pipeline's components.

    `path`: the pipeline's folder or cached hub id. Raises LoraError where no key matches a module, or a factor's
    shape does not fit its module."""
    from diffusers.loaders.lora_base import _load_lora_into_text_encoder
    from peft.tuners.lora import LoraLayer

    state_dict, alphas, metadata = read_state_dict(pipeline_class, file)
    models = skeletons(path, components_in(state_dict))
    out: Factors = {}
    named: dict[str, str] = {}  # each key's module, as `<component>.<module>` (after the loaders' conversions)
    for name in components_in(state_dict):
        model = models.get(name)
        if model is None:
            continue
        values = _text_encoder_values(state_dict, name, model) if not hasattr(model, "load_lora_adapter") else {}
        named |= {f"{name}.{k}": f"{name}.{_module(k)}" for k in values or _peft_keys(state_dict, name)}
        try:
            with _adapters_stay_put(), _quiet():
                if hasattr(model, "load_lora_adapter"):  # a diffusers model
                    model.load_lora_adapter(
                        state_dict,
                        prefix=name,
                        network_alphas=alphas,
                        metadata=metadata,
                        adapter_name="meshgen",
                        low_cpu_mem_usage=True,
                    )
                else:  # a transformers text encoder: the loader every pipeline with one uses
                    model.to = lambda *a, _m=model, **k: _m  # it ends by moving the encoder to its device: meta here
                    _load_lora_into_text_encoder(
                        state_dict,
                        alphas,
                        model,
                        prefix=name,
                        text_encoder_name=name,
                        adapter_name="meshgen",
                        metadata=metadata,
                        low_cpu_mem_usage=True,
                    )
        except (RuntimeError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            said = str(e).lower()  # torch, PEFT and transformers each word a shape mismatch their own way
            if "size mismatch" in said or "shape" in said or "mismatched_sizes" in said:
                raise LoraError(f"its {name} factors' shapes do not match the model's layers ({first})") from None
            if "not found in the base model" in str(e) or "Target modules" in str(e):
                continue  # no module of this component matches: judged over all components below
            raise LoraError(f"diffusers cannot read its {name} keys ({first})") from None
        except IndexError:  # the text-encoder loader finds no rank when none of its keys names a layer of the model
            continue  # judged over all components below, as PEFT's "not found" (the unmatched keys are refused)
        layers = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer) and "meshgen" in m.lora_A}
        for n, m in layers.items():
            if m.use_dora.get("meshgen") or m.lora_bias.get("meshgen") or not isinstance(m.base_layer, torch.nn.Linear):
                raise LoraError(f"{name}.{n} is not a plain LoRA on a linear layer (DoRA, lora bias or another layer)")
            A, B = m.lora_A["meshgen"].weight, m.lora_B["meshgen"].weight
            A, B = values.get(f"{n}.lora_A.weight", A), values.get(f"{n}.lora_B.weight", B)
            if A.is_meta or B.is_meta:
                raise LoraError(f"no factors were read for {name}.{n}")
            w = m.base_layer.weight
            o, i = (w.shape[1], w.shape[0]) if m.fan_in_fan_out else tuple(w.shape)
            if tuple(B.shape) != (o, A.shape[0]) or A.shape[1] != i:
                raise LoraError(
                    f"{name}.{n}: factors {tuple(B.shape)} x {tuple(A.shape)} do not fit its weight {tuple(w.shape)}"
                )
            out.setdefault(name, {})[n] = Factor(A.detach(), B.detach(), float(m.scaling["meshgen"]), m.fan_in_fan_out)
    if not out:
        raise LoraError(
            "none of its keys matches a module of the model (components it names: "
            f"{', '.join(components_in(state_dict)) or 'none'})"
        )
    matched = {f"{c}.{n}" for c, modules in out.items() for n in modules}
    # Keys of a component the model lacks keep their own names; those of its components, the loaders' names.
    keys = [k for k in state_dict if k.split(".", 1)[0] not in models] + list(named)
    unmatched = [k for k in keys if named.get(k, k) not in matched]
    if unmatched:
        raise LoraError(
            f"{len(unmatched)} of its {len(keys)} keys match no layer of the model "
            f"({', '.join(unmatched[:5])}{', ...' if len(unmatched) > 5 else ''}); a misspelt prefix fuses the "
            "LoRA only in part"
        )
    return out


def _peft_keys(state_dict: dict, prefix: str) -> list[str]:
    """A diffusers model's keys as its `load_lora_adapter` names them (prefix off, PEFT's names)."""
    from diffusers.utils import convert_unet_state_dict_to_peft

    sd = {k.removeprefix(f"{prefix}."): v for k, v in state_dict.items() if k.startswith(f"{prefix}.")}
    return list(convert_unet_state_dict_to_peft(sd) if sd and "lora_A" not in next(iter(sd)) else sd)


def _module(key: str) -> str:
    """`x.y.lora_A.weight` -> `x.y`, `x.y.alpha` -> `x.y`."""
    return key.split(".lora_", 1)[0] if ".lora_" in key else key.rsplit(".", 1)[0]


def non_finite(file: Path) -> tuple[str, int, int] | None:
    """(the first tensor's key, its count of NaN and inf values, the file's count) where the file holds any; the
    tensors read on CPU one at a time (a LoRA is small, and floats it holds only in its own keys)."""
    from safetensors import safe_open

    first, total = None, 0
    with safe_open(str(file), framework="pt", device="cpu") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            n = int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0
            if n and first is None:
                first = (key, n)
            total += n
    return None if first is None else (*first, total)


def _text_encoder_values(state_dict: dict, prefix: str, model) -> dict:
    """The text encoder's factors by PEFT key, converted as diffusers' `_load_lora_into_text_encoder` converts them
    (transformers then loads them onto the model's device, which for a meta skeleton keeps no values)."""
    from diffusers.utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft

    sd = {k.removeprefix(f"{prefix}."): v for k, v in state_dict.items() if k.startswith(f"{prefix}.")}
    sd = convert_state_dict_to_peft(convert_state_dict_to_diffusers(sd))
    if not hasattr(model, "text_model"):
        sd = {k.removeprefix("text_model."): v for k, v in sd.items()}
    return sd


@contextlib.contextmanager
def _quiet():
    """diffusers and PEFT warn about each key they skip; the checks here say what matters once."""
    names = ("diffusers", "peft", "transformers")
    saved = [logging.getLogger(n).level for n in names]
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for n, level in zip(names, saved, strict=True):
            logging.getLogger(n).setLevel(level)


def skeletons(path: str, names: list[str]) -> dict[str, torch.nn.Module]:
    """Components `names` of the pipeline at `path` (a folder or cached hub id), built on the meta device."""
    import importlib

    from launcher.worker.pipeline import component_classes

    classes = component_classes(path)
    out = {}
    for name in names:
        if name not in classes:
            continue
        library, class_name = classes[name]
        cls = getattr(importlib.import_module(library), class_name)
        with torch.device("meta"), _quiet():
            if library == "diffusers":
                out[name] = cls.from_config(cls.load_config(path, subfolder=name))
            else:
                out[name] = cls(cls.config_class.from_pretrained(path, subfolder=name))
    return out
