"""`python tools/mutants.py ROOM --kinds`: what the room's unkilled mutants change, read from mutmut's mutated files.

mutmut writes each function's original (`<name>__mutmut_orig`) and each of its mutants (`<name>__mutmut_<n>`) into
mutants/<module>.py. A mutant's changed lines are found by comparing the two, and the statement of the original that
holds them says what kind of change it is:
- "log text": inside a logging call (`logger.info(...)`, `stage.debug(...)`): what a log line says, or whether it
  is written;
- "error text": inside a `raise` statement: the wording of an error (its type and where it is raised stay);
- "behaviour": anything else.
A "behaviour" survivor is a change of what the code does that no test noticed; the other two change what a person
reads, which DESIGN.md fixes only for the lines it quotes.
"""

from __future__ import annotations

import ast
import difflib
import re
import textwrap
from collections import Counter
from pathlib import Path

LOG_CALLS = {"debug", "info", "warning", "error", "exception", "critical"}
NAME = re.compile(r"(?P<func>.+)__mutmut_(?P<n>orig|\d+)$")
NAME_IN_DEF = re.compile(r"__mutmut_(orig|\d+)\(")


def functions(source: str) -> dict[str, str]:
    """Each mutmut copy of a function in a mutated file, by its name, as its source text."""
    tree, lines, out = ast.parse(source), source.splitlines(), {}
    for node in ast.walk(tree):  # whole lines (not ast.get_source_segment, which splits the file at each call)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and NAME.match(node.name):
            out[node.name] = "\n".join(lines[node.lineno - 1 : node.end_lineno])
    return out


def changed_lines(orig: str, mutant: str) -> set[int]:
    """Line numbers (1-based, in `orig`) that the mutant replaced or removed; the line before an insertion."""
    a, b = orig.splitlines(), mutant.splitlines()
    a[0] = b[0] = ""  # the def line differs by the function's name only
    out = set()
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag != "equal":
            out.update(range(i1 + 1, max(i2, i1 + 1) + 1))
    return out


def _is_log_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOG_CALLS
    ) and not (isinstance(node.func.value, ast.Name) and node.func.value.id in ("parser", "sys"))


def _holds(node: ast.AST, line: int) -> bool:
    start = getattr(node, "lineno", None)
    return start is not None and start <= line <= (getattr(node, "end_lineno", None) or start)


def kind_of(orig: str, lines: set[int]) -> str:
    """The kind of change a mutant makes at `lines` of the function `orig`."""
    tree = ast.parse(textwrap.dedent(orig))
    kinds = set()
    for line in lines:
        spans = [n for n in ast.walk(tree) if _holds(n, line) and not isinstance(n, ast.FunctionDef)]
        if any(_is_log_call(n) for n in spans):
            kinds.add("log text")
        elif any(isinstance(n, ast.Raise) for n in spans):
            kinds.add("error text")
        else:
            kinds.add("behaviour")
    return "behaviour" if "behaviour" in kinds or not kinds else min(kinds)


def _pair(copies: dict[str, str], name: str) -> tuple[str | None, str | None]:
    """The original function and the mutant's copy of it (None where the file holds no such copy)."""
    short = name.rsplit(".", 1)[1]
    m = NAME.match(short)
    return (copies.get(f"{m['func']}__mutmut_orig") if m else None), copies.get(short)


def kinds(mutants: Path, module_path: str, names: list[str]) -> dict[str, str]:
    """Each of `names` (mutmut's `<module>.<function>__mutmut_<n>`) in mutants/<module_path> and its kind."""
    copies = functions((mutants / module_path).read_text())
    out = {}
    for name in names:
        orig, mutant = _pair(copies, name)
        if orig is None or mutant is None:
            out[name] = "behaviour"  # not found as a copy: count it as the worst kind
            continue
        out[name] = kind_of(orig, changed_lines(orig, mutant))
    return out


def diff(mutants: Path, module_path: str, name: str) -> list[str]:
    """The mutant's change, as `-` lines of the original and `+` lines of the mutant."""
    return change(*_pair(functions((mutants / module_path).read_text()), name))[1]


def change(orig: str | None, mutant: str | None) -> tuple[int, list[str]]:
    """The first line the mutant changes (1: the def line, where a default value changed) and `diff`'s lines."""
    a, b = (orig or "").splitlines(), (mutant or "").splitlines()
    if a and b:  # the def lines differ by the function's name too
        a[0], b[0] = (NAME_IN_DEF.sub("(", line, count=1) for line in (a[0], b[0]))
    ops = difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes()
    first = next((i1 + 1 for tag, i1, *_ in ops if tag != "equal"), 0)
    lines = [line for line in difflib.unified_diff(a, b, lineterm="", n=0) if line[:1] in "-+"]
    return first, [line for line in lines if line[:3] not in ("---", "+++")]


def kind_counts(mutants: Path, by_module: dict[str, list[str]]) -> Counter:
    found: Counter = Counter()
    for module_path, names in by_module.items():
        found.update(kinds(mutants, module_path, names).values())
    return found
