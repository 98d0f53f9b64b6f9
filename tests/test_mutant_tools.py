"""tools/mutant_kinds.py: a mutant's kind from the statement of the original that holds its change, on a mutated
file written here the way mutmut writes them (the original and each mutant as functions side by side)."""

import sys

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
