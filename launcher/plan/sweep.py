"""Parameter sweeps (`generate.sweep`): every prompt at every combination of the swept values.

`generate.sweep` maps a generation key to a list of values. The combinations are numbered v = 0..V-1 in the
mapping's order, the last key changing fastest (itertools.product's order). A sample's id is `<base id>@<v>`,
where the base id is what a plain run names it (`<prompt id>` or `<prompt id>-<k>`), and it keeps the base id's
seed: a variant whose settings equal the plain run's gives that run's image, so a sweep isolates the effect of
the swept settings. Here: the keys, their checks (no model needed), the variants and their ids.
"""

from __future__ import annotations

import itertools
import math

from launcher.errors import ConfigError
from launcher.sources.bounds import LORA_SCALE, NUMBERS

KEYS = ("guidance_scale", "num_inference_steps", "height", "width", "true_cfg_scale")  # and lora_scale.<i>
INT_KEYS = ("num_inference_steps", "height", "width")
LORA_PREFIX = "lora_scale."


def raw_sweep(gen):
    """`generate.sweep` as plain Python, in its order ({} when unset)."""
    from omegaconf import OmegaConf

    s = gen.get("sweep") if hasattr(gen, "get") else getattr(gen, "sweep", None)
    s = OmegaConf.to_container(s) if OmegaConf.is_config(s) else s
    return {} if s is None else s  # check_sweep refuses what is not a mapping


def sweep_of(gen) -> dict[str, list]:
    """The sweep with its values cast as the pipeline takes them (ints, floats); {} when there is none.

    Cast so that `[4, 4.0]` and `[4.0]` are the same sweep in the fingerprint. Call after `check_sweep`."""
    out = {}
    for k, values in raw_sweep(gen).items():
        cast = int if k in INT_KEYS else float
        try:
            out[k] = [cast(v) for v in values]
        except (TypeError, ValueError):  # not checked yet (a fingerprint of a bad config): as written
            out[k] = values
    return out


def variants(gen) -> list[dict]:
    """The sweep's combinations, v = 0..V-1 (the last key fastest); [{}] without a sweep."""
    s = sweep_of(gen)
    return [dict(zip(s, combo, strict=True)) for combo in itertools.product(*s.values())]


def n_variants(gen) -> int:
    """V: samples per base id (1 without a sweep)."""
    return math.prod(len(v) for v in sweep_of(gen).values())


def true_cfg_scales(cfg) -> list[float]:
    """The true_cfg_scale values the pipeline is called with (swept, else model.call_kwargs'); [] where unset."""
    swept = sweep_of(cfg.generate).get("true_cfg_scale")
    value = (cfg.model.get("call_kwargs") or {}).get("true_cfg_scale")
    return [float(v) for v in swept] if swept else [] if value is None else [float(value)]


def lora_index(key: str) -> int | None:
    """i of a `lora_scale.<i>` key, else None."""
    rest = key.removeprefix(LORA_PREFIX)
    return int(rest) if rest != key and rest.isdigit() and str(int(rest)) == rest else None


def check_sweep(gen, loras) -> None:
    """Keys known, values lists of numbers within the bounds of a config value, no value twice (exit 2 naming
    the key and value). Sizes against the model's size factor are checked where the model is known
    (launcher/checks/sweep_checks.py)."""
    s = raw_sweep(gen)
    if not isinstance(s, dict):
        raise ConfigError(f"generate.sweep={s!r} must map keys to lists, e.g. {{guidance_scale: [2.5, 4.0]}}")
    for key, values in s.items():
        where = f"generate.sweep.{key}"
        if key not in KEYS and lora_index(str(key)) is None:
            raise ConfigError(
                f"{where}: unknown sweep key; sweep one of {', '.join(KEYS)} or lora_scale.<i> "
                "(the scale of the i-th of model.loras)"
            )
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}={values!r} must be a non-empty list of values, e.g. [2.5, 4.0]")
        seen = set()
        for v in values:
            problem = _problem(key, v)
            if problem:
                raise ConfigError(f"{where}: value {v!r} {problem}")
            if v in seen:
                raise ConfigError(f"{where}: value {v!r} is listed twice; each combination is generated once")
            seen.add(v)
        i = lora_index(str(key))
        if i is not None and i >= len(loras or []):
            raise ConfigError(
                f"{where}: model.loras has no entry {i} ({len(loras or [])} LoRAs configured); "
                "sweep the scale of a configured LoRA"
            )


def _problem(key: str, v) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return "is not a number"
    if key in INT_KEYS:
        if isinstance(v, float) and not v.is_integer():
            return "is not a whole number"
        low, high = NUMBERS.get(key, (1, None))  # sizes: the family's pixel limit is checked with the model
        if v < low or (high is not None and v > high):
            return f"must be in {low}..{high:g}" if high else f"must be at least {low}"
        return None
    if not math.isfinite(v):
        return "is not a finite number"
    low, high = LORA_SCALE if lora_index(key) is not None else NUMBERS.get(key, (-math.inf, math.inf))
    return None if low <= v <= high else f"must be in {low:g}..{high:g}"


def check_sweep_columns(table, cfg) -> None:
    """Refuse a sweep key that is also a per-row column of the prompt source: which of the two would a sample
    use? (One shard's rows, as the plan reads them; a column empty throughout is no column.)"""
    for key in raw_sweep(cfg.generate):
        if key in table.schema.names and table.column(key).null_count < table.num_rows:
            raise ConfigError(
                f"dataset {cfg.dataset.path} has a column {key!r}, which generate.sweep.{key} also sets; "
                "drop the column or the sweep key"
            )
