"""Checks of `generate.sweep` (and of `model.call_kwargs.true_cfg_scale`) that need the model's configs (never its
weights), at preflight (exit 2).

The checks that need no model (keys, value types and bounds, repeats, LoRA indices) are in
launcher/plan/sweep.py and run with the other settings, in a dry run too.
"""

from __future__ import annotations

import itertools

from launcher.errors import ConfigError
from launcher.plan.sweep import lora_index, sweep_of

# Sweeping a LoRA's scale needs the weights re-fused per scale (or each scale's batches grouped and fused once);
# the batches carry their scales and the job calls its `set_lora_scales` hook (launcher/worker/staged.py), but no fusing
# follows it yet, so such a sweep is refused rather than silently generated at the loaded scales.
LORA_SCALE_SWEEP = False


def check_sweep_model(cfg, model) -> None:
    """Swept sizes against the model's size factor and its family's pixel limit (each combination), and keys
    the family or this version cannot follow (swept, or in model.call_kwargs). `model`: model_checks.Model."""
    from launcher.checks.model_checks import size_rule
    from launcher.models import GENERIC

    fam = getattr(model, "family", None) or GENERIC
    if fam is not GENERIC and not fam.true_cfg and "true_cfg_scale" in (cfg.model.get("call_kwargs") or {}):
        raise ConfigError(  # Qwen-Image's guidance_scale is its true_cfg_scale; FLUX.2's pipeline takes none
            f"model.call_kwargs.true_cfg_scale: this model's family ({fam.name}) has no true_cfg_scale apart from "
            "guidance_scale; use generate.guidance_scale"
        )
    swept = sweep_of(cfg.generate)
    if not swept:
        return
    for key in swept:
        i = lora_index(key)
        if i is not None and not LORA_SCALE_SWEEP:
            raise ConfigError(
                f"generate.sweep.{key}: sweeping a LoRA's scale is not supported yet (the weights would need "
                f"re-fusing per scale); set model.loras[{i}].scale and run each scale into its own output.dir"
            )
    if "true_cfg_scale" in swept:
        if not fam.true_cfg:
            raise ConfigError(
                f"generate.sweep.true_cfg_scale: this model's family ({fam.name}) has no true_cfg_scale apart from "
                "guidance_scale; sweep guidance_scale instead"
            )
    rule = size_rule(cfg, model)
    heights = swept.get("height", [cfg.generate.height])
    widths = swept.get("width", [cfg.generate.width])
    for key, values in (("height", heights), ("width", widths)):
        for v in values:
            if v % rule.multiple:
                fix = max(rule.multiple, v // rule.multiple * rule.multiple)
                raise ConfigError(
                    f"generate.sweep.{key}: value {v} is not a multiple of {rule.multiple} (this model's size "
                    f"factor); use e.g. {fix}"
                )
    for h, w in itertools.product(heights, widths):
        problem = rule.problem(h, w)
        if problem:
            raise ConfigError(f"generate.sweep: {problem}")
