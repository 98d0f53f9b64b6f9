"""tools/mutant_kinds.py: a mutant's kind from the statement of the original that holds its change, on a mutated
file written here the way mutmut writes them (the original and each mutant as functions side by side)."""

import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))

from mutant_kinds import diff, kinds  # noqa: E402

FUNCTION = """
def x_f__mutmut_NAME(x):
    if x < 0:
        raise ValueError(f"x={x} must be at least 0")
    logger.info(
        "x is %d",
        x,
    )
    return x + 1
"""
MUTANTS = {  # mutant n: (the original's text, what mutant n has in its place)
    1: ('"x is %d"', '"XXx is %dXX"'),
    2: ('ValueError(f"x={x} must be at least 0")', "ValueError(None)"),
    3: ("x < 0", "x <= 0"),
    4: ("x + 1", "x - 1"),
}


def mutated_file() -> str:
    """The original, then each mutant: each a copy of it with one change, as mutmut writes a module."""
    copies = [FUNCTION.replace("NAME", "orig")]
    for n, (old, new) in MUTANTS.items():
        assert FUNCTION.count(old) == 1, old
        copies.append(FUNCTION.replace("NAME", str(n)).replace(old, new))
    return "\n".join(copies)


def test_each_mutant_is_the_kind_of_the_statement_its_change_is_in(tmp_path):
    (tmp_path / "m.py").write_text(mutated_file())
    names = [f"pkg.m.x_f__mutmut_{n}" for n in (1, 2, 3, 4, 9)]
    assert kinds(tmp_path, "m.py", names) == {
        "pkg.m.x_f__mutmut_1": "log text",  # a line inside a multi-line logging call
        "pkg.m.x_f__mutmut_2": "error text",
        "pkg.m.x_f__mutmut_3": "behaviour",  # the condition of the raise, not its text
        "pkg.m.x_f__mutmut_4": "behaviour",
        "pkg.m.x_f__mutmut_9": "behaviour",  # not in the file: counted as the worst kind
    }


def test_a_mutants_change_is_the_originals_lines_it_replaced_and_its_own(tmp_path):
    """`--sample` shows each drawn mutant's change: `-` the original's line, `+` the mutant's, nothing else."""
    (tmp_path / "m.py").write_text(mutated_file())
    assert diff(tmp_path, "m.py", "pkg.m.x_f__mutmut_3") == ["-    if x < 0:", "+    if x <= 0:"]
    assert diff(tmp_path, "m.py", "pkg.m.x_f__mutmut_1") == ['-        "x is %d",', '+        "XXx is %dXX",']


def test_a_default_value_changed_in_the_def_line_is_shown_as_its_change(tmp_path):
    """mutmut mutates a parameter's default too: the def lines differ by the function's name and by the value."""
    text = mutated_file() + FUNCTION.replace("NAME", "5").replace("(x):", '(x=""):')
    (tmp_path / "m.py").write_text(text.replace("def x_f__mutmut_orig(x):", 'def x_f__mutmut_orig(x="a"):'))
    assert change_of(tmp_path, "pkg.m.x_f__mutmut_5")[0] == 1
    assert diff(tmp_path, "m.py", "pkg.m.x_f__mutmut_5") == ['-def x_f(x="a"):', '+def x_f(x=""):']


def change_of(folder, name):
    from mutant_kinds import _pair, change, functions

    return change(*_pair(functions((folder / "m.py").read_text()), name))


REGISTER = """# judged by hand
== pkg.m.x_f__mutmut_7 @ 5
-    if x < 0:
+    if x <= 0:
equivalent: x is never 0 here

== pkg.m.x_f__mutmut_8 @ 9
-    return x + 1
+    return x - 1

open: no test reads f's result
"""


def test_a_verdict_is_found_again_by_function_line_and_change_not_by_mutmuts_number(tmp_path):
    """docs/survivors/ROOM.txt: mutmut numbers a function's mutants anew when it changes; the change and where it is
    in the function stay. A change moved to another line is judged again; a log-text mutant is text unjudged."""
    from mutant_verdicts import judge, parse, survivors

    (tmp_path / "m.py").write_text(mutated_file())
    found = survivors(tmp_path, {"m.py": [f"pkg.m.x_f__mutmut_{n}" for n in (1, 2, 3, 4)]})
    assert [(s.line, s.kind) for s in found] == [(5, "log text"), (3, "error text"), (2, "behaviour"), (8, "behaviour")]
    (tmp_path / "room.txt").write_text(REGISTER.replace("@ 5", "@ 2").replace("@ 9", "@ 8"))
    said = judge(found, parse(tmp_path / "room.txt"))
    assert said == {
        "pkg.m.x_f__mutmut_1": "text",
        "pkg.m.x_f__mutmut_2": "unjudged",
        "pkg.m.x_f__mutmut_3": "equivalent",  # mutant 7 in the file: the same change at the same place
        "pkg.m.x_f__mutmut_4": "open",
    }
    (tmp_path / "room.txt").write_text(REGISTER)  # the same changes, judged at other lines: not these mutants
    assert set(judge(found, parse(tmp_path / "room.txt")).values()) == {"text", "unjudged"}


def test_a_block_without_a_known_verdict_and_a_reason_names_its_line(tmp_path):
    from mutant_verdicts import parse

    for good, bad, where in (
        ("equivalent: x is never 0 here", "maybe: who knows", "5: the block of line 2"),
        ("open: no test reads f's result", "open:", "11: the block of line 7"),
    ):
        (tmp_path / "room.txt").write_text(REGISTER.replace(good, bad))
        with pytest.raises(ValueError, match=f"room.txt:{where} needs '<equivalent|text|launched|open|killed>: <why>'"):
            parse(tmp_path / "room.txt")
    (tmp_path / "room.txt").write_text("== pkg.m.x_f__mutmut_7\n")
    with pytest.raises(ValueError, match="room.txt:1: expected '== <mutant> @ <line>'"):
        parse(tmp_path / "room.txt")
