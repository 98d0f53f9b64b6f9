"""One-line messages for configuration errors: which key or override is wrong, and what would be right.

Hydra and OmegaConf report them in several lines, with the useful part in the middle; these functions pull it
out, and for an unknown key name the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing

from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError


def unknown_keys(node: DictConfig, schema: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(schema)
    out = []
    for key in node:
        if key not in hints:
            out.append(f"{prefix}{key}")
        elif dataclasses.is_dataclass(hints[key]) and isinstance(node[key], DictConfig):  # ty: ignore[invalid-argument-type]
            out += unknown_keys(node[key], hints[key], f"{prefix}{key}.")  # ty: ignore[invalid-argument-type]
    return out


def unknown_key_message(full_key: str, root: type) -> str | None:
    """`generate.heigth` -> the valid keys of `generate`, and the closest one; None if free-form (call_kwargs)."""
    *parents, leaf = full_key.split(".")
    schema: type = root
    for i, part in enumerate(parents):
        hint = typing.get_type_hints(schema).get(part)
        if hint is None:  # the unknown key is a parent: report that one
            return unknown_key_message(".".join(parents[: i + 1]), root)
        if not dataclasses.is_dataclass(hint):
            return None
        schema = hint
    keys = [f.name for f in dataclasses.fields(schema)]  # ty: ignore[invalid-argument-type]
    group = ".".join(parents)
    prefix = f"{group}." if group else ""
    close = difflib.get_close_matches(leaf, keys, n=1)
    hint = f"did you mean {prefix}{close[0]}? " if close else ""
    return (
        f"bad configuration: unknown key {leaf!r} (full_key: {full_key}); {hint}"
        f"the keys of {group or 'a job'} are: {', '.join(keys)}"
    )


def one_line(e: Exception, root: type) -> str:
    # Hydra wraps the useful message (e.g. "Key 'heigth' not in 'GenerateConfig'") in a multi-line text.
    cause = e.__cause__ or e
    full_key = getattr(cause, "full_key", None)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and full_key:
        text = unknown_key_message(full_key, root)
        if text:
            return text
    if cause is not e and full_key:
        # Hydra's own lines after the first say how to fix it (e.g. "To append to your config use +key=value").
        return "; ".join([f"bad configuration: {_lines(cause)[0]} (full_key: {full_key})", *_lines(e)[1:]])
    return f"bad configuration: {'; '.join(_lines(e))}"


def parse_error(overrides: list[str], e: Exception) -> str:
    """Name the override that does not parse: Hydra's message may not, when several are given."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for o in overrides:
        try:
            parser.parse_override(o)
        except Exception as err:  # whatever the parser raises for this one override
            detail = _lines(err)[-1]
            return (
                f"bad configuration: cannot parse the override {o!r} ({detail}); write key=value, and quote a "
                f"value with special characters, e.g. 'model.path=\"~/models/x\"'"
            )
    return f"bad configuration: {'; '.join(_lines(e))}; overrides look like key=value"


def _lines(e: BaseException) -> list[str]:
    """The message's lines, with a listing ("Available options in 'mesh':" then one per line) on one line."""
    out: list[str] = []
    listing = False
    for ln in (ln.strip() for ln in str(e).splitlines()):
        if not ln or ln.startswith(("See https://", "Config search path")):
            if ln:
                break
            continue
        if listing and not ln.endswith(":") and "=" not in ln:
            out[-1] += (" " if out[-1].endswith(":") else ", ") + ln
            continue
        listing = ln.endswith(":")
        if not ln.startswith(("full_key:", "reference_type=", "object_type=")):
            out.append(ln)
    return out or [type(e).__name__]
