"""`model.loras` at preflight, one line and exit 2 each: a missing file, NaN or inf in any tensor, a family whose
diffusers pipeline has no LoRA loader, a file with a key that matches no module of the model (one misspelt
prefix would fuse it only in part), and factors whose shapes do not fit.

The keys and shapes are judged by diffusers' own loaders against the model's components built on the meta
device (launcher/worker/lora.py): no weights are read, only the LoRA files, which are small.
"""

from __future__ import annotations

import logging

from launcher.errors import ConfigError
from launcher.loras import lora_file, lora_refs

logger = logging.getLogger(__name__)


def check_loras(cfg, root) -> None:
    """`root`: the pipeline's folder on this host."""
    refs = lora_refs(cfg)
    if not refs:
        return
    from launcher.models import family_of, pipeline_class
    from launcher.worker.lora import LoraError, factors, loader_class, non_finite

    files = [lora_file(r) for r in refs]  # first: a missing file is the plainest mistake
    for ref, file in zip(refs, files, strict=True):
        try:
            bad = non_finite(file)
        except Exception as e:  # noqa: BLE001 - safetensors' own errors: a truncated or foreign file, one line
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ConfigError(f"model.loras[{ref.index}] {file} cannot be read as a LoRA ({first})") from None
        if bad:
            key, n, total = bad
            raise ConfigError(
                f"model.loras[{ref.index}] {file}: tensor {key!r} holds {n} non-finite values (NaN or inf; "
                f"{total} in the file), which would make every image black; use a sound checkpoint of the LoRA"
            )
    cls = pipeline_class(root)
    if loader_class(cls) is None:
        raise ConfigError(
            f"model.loras: diffusers has no LoRA loader for {cls or 'this pipeline'} (family "
            f"{family_of(cls).name}); remove model.loras, or use a model whose pipeline loads LoRAs"
        )
    for ref, file in zip(refs, files, strict=True):
        try:
            got = factors(cls, file, str(root))
        except LoraError as e:
            raise ConfigError(f"model.loras[{ref.index}] {file}: {e}; check that it was made for this model") from None
        except (OSError, ValueError, KeyError) as e:  # not a LoRA file diffusers can read at all
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ConfigError(f"model.loras[{ref.index}] {file} cannot be read as a LoRA ({first})") from None
        logger.info(
            "LoRA %d (%s, scale %s): %s",
            ref.index,
            file.name,
            ref.scale,
            ", ".join(f"{len(m)} {c} layers" for c, m in got.items()),
        )
