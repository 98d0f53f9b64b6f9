"""The judged survivors: what a person found each surviving mutant to be, kept in docs/survivors/<room>.txt (and,
for a large room, in docs/survivors/<room>.<part>.txt beside it).

A survivor is a change of the code that no fast test noticed. Each is judged once, by hand, into one of:
- equivalent: no input the product can see changes what it does (say why);
- text: a label, log line or warning text that no code, file or exit code reads;
- launched: only a launch runs the code (name the launched test that kills it);
- open: a real gap no test closes yet (say what test would);
- killed: a fast test written for it fails with it (name the test); the room's next run counts it killed, and the
  block then matches no survivor.
A "log text" mutant (tools/mutant_kinds.py: inside a logging call) is text without a line of its own.

The file holds one block a mutant, as `python tools/mutants.py ROOM --unjudged` prints them:

    == launcher.ledger.index.x_read__mutmut_12 @ 7
    -    if n > 0:
    +    if n >= 0:
    equivalent: n counts listed shards, never 0 here (read() returns early on an empty listing)

A verdict is found again by the function, the line of the change within it, and the change: mutmut numbers a
function's mutants anew when it changes, and a change of the function above the line makes the verdict go (judge
it again: the code it was about is not the code now).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from mutant_kinds import NAME, _pair, change, changed_lines, functions, kind_of

VERDICTS = ("equivalent", "text", "launched", "open", "killed")
HEADER = re.compile(r"^== (?P<name>\S+) @ (?P<line>\d+)$")
Key = tuple[str, int, tuple[str, ...]]


@dataclass(frozen=True)
class Verdict:
    verdict: str
    why: str
    where: str  # file:line of the block, for messages


def function_of(name: str) -> str:
    """`<module>.<function>` of mutmut's `<module>.<function>__mutmut_<n>`."""
    module, short = name.rsplit(".", 1)
    m = NAME.match(short)
    return f"{module}.{m['func'] if m else short}"


def parse(path: Path) -> dict[Key, Verdict]:
    """The verdicts of one room's file. Raises ValueError naming the file and line of a block it cannot read."""
    out: dict[Key, Verdict] = {}
    lines = path.read_text().splitlines() if path.exists() else []
    i = 0
    while i < len(lines):
        head = HEADER.match(lines[i])
        if not head:
            if lines[i].strip() and not lines[i].startswith("#"):
                raise ValueError(f"{path}:{i + 1}: expected '== <mutant> @ <line>', got {lines[i]!r}")
            i += 1
            continue
        start, i = i + 1, i + 1
        edit = []
        while i < len(lines) and lines[i][:1] in ("-", "+"):
            edit.append(lines[i])
            i += 1
        while i < len(lines) and not lines[i].strip():  # a blank line before the verdict is allowed
            i += 1
        word, _, why = (lines[i] if i < len(lines) else "").partition(":")
        if word not in VERDICTS or not why.strip():
            raise ValueError(f"{path}:{i + 1}: the block of line {start} needs '<{'|'.join(VERDICTS)}>: <why>'")
        key = (function_of(head["name"]), int(head["line"]), tuple(edit))
        out[key] = Verdict(word, why.strip(), f"{path}:{start}")
        i += 1
    return out


@dataclass
class Survivor:
    name: str
    line: int  # the first line the change touches: 1 is the function's def line
    change: list[str]
    kind: str  # tools/mutant_kinds.py's kind

    @property
    def key(self) -> Key:
        return (function_of(self.name), self.line, tuple(self.change))

    def block(self) -> str:
        return "\n".join([f"== {self.name} @ {self.line}", *self.change])


def survivors(mutants: Path, by_module: dict[str, list[str]]) -> list[Survivor]:
    """Each of the named mutants (by the mutated file that holds them) with its change, read from mutants/."""
    out = []
    for module_path, names in sorted(by_module.items()):
        copies = functions((mutants / module_path).read_text())
        for name in sorted(names):
            orig, mutant = _pair(copies, name)
            kind = kind_of(orig, changed_lines(orig, mutant)) if orig and mutant else "behaviour"
            out.append(Survivor(name, *change(orig, mutant), kind))
    return out


def judge(found: list[Survivor], verdicts: dict[Key, Verdict]) -> dict[str, str]:
    """Each survivor's verdict by name: its file's, "text" for a log-text one, "unjudged" where neither says."""
    out = {}
    for s in found:
        v = verdicts.get(s.key)
        out[s.name] = v.verdict if v else ("text" if s.kind == "log text" else "unjudged")
    return out
