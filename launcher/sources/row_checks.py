"""Checks that one row can fail, beyond its values' bounds (launcher/sources/bounds.py): its id must make a file
name on any filesystem the output may live on, and its line must be short enough to be a row at all.

Both readers use them (the fast one vectorised, launcher/sources/prompts_fast.py; the exact one row by row, which
words the error), so a row that would fail at write is refused, or set aside, at planning.
"""

from __future__ import annotations

import re

from launcher.sources.bounds import TEXT_BYTES

# An id names its sample's files (`<id>[-k][@v].<ext>`, launcher/plan/shards.py file_stem): 200 bytes leave room
# for the sample suffix and the extension within the 255 bytes a file name may take on ext4, XFS, NTFS, or an
# object key's last part that a local copy of it becomes.
ID_BYTES = 200
# Control characters (C0, DEL, C1): file_stem would hide them, but a terminal, a log line or a tar name would not.
CONTROL = r"[\x00-\x1f\x7f-\x9f]"
_CONTROL = re.compile(CONTROL)
# The longest line a text source may hold: a row's prompt and negative prompt at their 64 KiB each, JSON-escaped
# (up to 6 bytes a character), and room for its other columns. A longer line is refused while it is read, so a
# 300 MB line costs this much memory, not its size.
LINE_BYTES = 16 * TEXT_BYTES


def id_problem(rid: str, column: str) -> str | None:
    """Why `rid` cannot be a sample's id (it names the sample's files), with the fix; None if it can."""
    if rid == "":
        return f"the id ({column!r}) is empty; give the row an id (it names the row's image files)"
    if m := _CONTROL.search(rid):
        return f"the id ({column!r}) holds the control character {m.group()!r}; remove it from the id"
    if (n := len(rid.encode())) > ID_BYTES:
        return (
            f"the id ({column!r}) is {n} bytes of UTF-8, more than the {ID_BYTES} a file name can take; "
            "use a shorter id (e.g. a hash of it)"
        )
    return None


def line_problem(n: int) -> str:
    return (
        f"the line is longer than {LINE_BYTES // 1024} KiB (a prompt may hold {TEXT_BYTES // 1024} KiB); "
        "fix or remove that line"
    )


class Bad:
    """A row that cannot be read as a row (malformed, not UTF-8, too long): the reader's placeholder for it, so
    that the rows after it keep their positions."""

    __slots__ = ("reason", "text")

    def __init__(self, reason: str, text: str = ""):
        self.reason = reason
        self.text = text  # what a CSV reader reads in its place: a line not UTF-8 keeps its quotes and commas
