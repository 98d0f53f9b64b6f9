"""`./launch.sh --help`: the confs (each file's whole leading comment), the config groups, and every key with its
type and default (from the schema in launcher/config.py, so the list cannot drift from what composes) and what it
means (launcher/keys_doc.py, which docs/reference.md is generated from too)."""

from __future__ import annotations

import dataclasses
import types
import typing

from omegaconf import MISSING

USAGE = """usage: ./launch.sh [--dry-run] [--help] [--cfg job] [conf=NAME|conf=PATH.yaml] [KEY=VALUE ...]

  --dry-run   every check the run makes, without weights; print the plan and the commands; exit 2 where the run would
  --cfg job   print the composed config and exit
  conf=NAME   a job in conf/ (default tiny); conf=PATH.yaml: a job file anywhere, whose defaults may name the
              groups below (model: flux2_dev) and files beside it
  KEY=VALUE   any key below (Hydra override syntax: group=option picks a group's file, +key=value adds a key)
Exit status: 0 done, 2 bad configuration or input, 3 some shards not done, 4 output folder held by a live run."""


def help_text() -> str:
    from launcher.config import CONF_DIR, JobConfig, available_confs
    from launcher.keys_doc import describe

    lines = [USAGE, "", "confs:"]
    for name in available_confs():
        lines += _wrapped(f"  {name:<20} ", conf_about(CONF_DIR / f"{name}.yaml"), 23)
    lines += ["", "groups (group=option):"]
    for group in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and any(p.glob("*.yaml"))):
        lines += _wrapped(f"  {group.name:<20} ", ", ".join(sorted(p.stem for p in group.glob("*.yaml"))), 23)
    lines += ["", "keys (type, default; what it means):"]
    for key, kind, default in keys(JobConfig):
        lines.append(f"  {key:<34} {kind:<16} {default}")
        lines += _wrapped("      ", describe(key), 6)
    return "\n".join(lines)


def conf_about(path) -> str:
    """A conf file's description: its leading comment lines, joined."""
    about = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        about.append(line.lstrip("#").strip())
    return " ".join(about)


def _wrapped(first: str, text: str, indent: int, width: int = 116) -> list[str]:
    import textwrap

    if not text:
        return [first.rstrip()] if first.strip() else []
    return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=" " * indent, break_on_hyphens=False)


# Where the schema's type is wider than what a key takes (OmegaConf has no int-or-"auto" type).
TYPES = {"mesh.dp": "int | auto", "mesh.tp": "int | auto", "run.shards": "str | list[int]"}
SHOWN = {"name": "(the conf's name)", "output.dir": "outputs/<name> in the checkout"}


def keys(cls, prefix: str = ""):
    """(dotted key, type, default) of every leaf of a schema dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from keys(kind, f"{prefix}{f.name}.")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = MISSING
        shown = "(required)" if default == MISSING else repr(default)
        key = f"{prefix}{f.name}"
        yield key, TYPES.get(key, _type_name(kind)), SHOWN.get(key, shown)


def _type_name(kind) -> str:
    if kind is typing.Any:
        return "any"
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return f"{_type_name(args[0])} | null" if len(args) == 1 else " | ".join(_type_name(a) for a in args)
    if typing.get_origin(kind) in (list, dict):
        return f"{typing.get_origin(kind).__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(kind, "__name__", str(kind))
