"""Every `./launch.sh ...` command in the README, docs/ and deploy/ runs as written: each is dry-run here.

What a command names that this machine cannot have (a bucket, /data, a user's prompts file, a LoRA on their disk,
the earlier run an edit job reads) is swapped for a local stand-in of the same kind; the rest of the command is
kept word for word, so a key that was renamed, a conf that is gone or a value the checks refuse fails the test.
The deploy scripts' commands, built from shell variables, are dry-run under each engine's environment in
tests/test_deploy.py.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from conftest import REPO

from tools.make_tiny_lora import FLUX2, make_lora

pytestmark = pytest.mark.usefixtures("default_model")  # conf tiny's dry runs read the checkout's tiny model

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "deploy").iterdir())]
COMMAND = re.compile(r"\./launch\.sh(?: [^`\n]*)?")


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for each launch.sh command in the docs: code blocks (backslash continuations joined)
    and inline code. The synopsis (`[--dry-run] ...`) and commands built from shell variables are left out."""
    found: dict[str, str] = {}
    for path in DOCS:
        if not path.is_file():
            continue
        text = path.read_text().replace("\\\n", " ")
        for n, line in enumerate(text.splitlines(), 1):
            for m in COMMAND.finditer(line):
                cmd = m.group(0).split(" #")[0].strip().rstrip("`").strip()
                if "[" in cmd.split("'")[0] or "$" in cmd or "<" in cmd:
                    continue  # the usage synopsis, a shell variable or a placeholder: not a command as written
                found.setdefault(re.sub(r"\s+", " ", cmd), f"{path.relative_to(REPO)}:{n}")
    return [(where, cmd) for cmd, where in found.items()]


def job_file_example() -> str:
    """The README's job file (the yaml block under "A job file")."""
    section = (REPO / "README.md").read_text().split("## A job file", 1)[1]
    return section.split("```yaml\n", 1)[1].split("```", 1)[0]


def example_row() -> dict:
    """docs/guide.md's example JSONL row."""
    guide = (REPO / "docs" / "guide.md").read_text()
    return json.loads(guide.split("```json\n", 1)[1].split("```", 1)[0])


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory, tiny_model, run_job) -> dict:
    d = tmp_path_factory.mktemp("docs")
    row = example_row()
    (d / "prompts.jsonl").write_text(json.dumps(row) + "\n" + json.dumps({**row, "id": "cat-002"}) + "\n")
    (d / "job.yaml").write_text(job_file_example())
    return {
        "txt": str(REPO / "conf" / "prompts" / "tiny.txt"),
        "jsonl": str(d / "prompts.jsonl"),
        "job": str(d / "job.yaml"),
        "lora": str(make_lora(tiny_model, d / "lora.safetensors", FLUX2, seed=1)),
        "run": str(run_job()),  # the earlier run an edit job reads
        "out": d,
    }


def localized(cmd: str, s: dict, n: int) -> list[str]:
    """The command's arguments with what cannot exist here swapped for a stand-in, plus a fresh output folder."""
    args = shlex.split(cmd)[1:]
    out = []
    for a in args:
        key, _, value = a.partition("=")
        if key == "conf" and value.endswith(".yaml") and not Path(value).exists():
            a = f"conf={s['job']}"
        elif key == "dataset.path" and not Path(value).exists():
            a = f"dataset.path={s['jsonl'] if value.endswith('.jsonl') else s['txt']}"
            if value.startswith("outputs/"):  # an earlier run of the tiny job, as an edit job's source
                a = f"dataset.path={s['run']}"
        elif key == "output.dir":
            continue
        elif key == "model.loras":
            a = re.sub(r"path:[^,}]+", f"path:{s['lora']}", a)
        out.append(a)
    if "--help" in out:
        return out
    edit = "conf=tiny_edit" in out or "job=edit" in out
    job_file = any(a.startswith("conf=") and a.endswith(".yaml") for a in out)
    extra = [f"output.dir={s['out'] / f'out-{n}'}"]
    if edit and not any(a.startswith("dataset.path=") for a in out):
        extra.append(f"dataset.path={s['run']}")
    if job_file:  # the job file names a bucket and /data: the same job, pointed at the stand-ins
        extra += [f"dataset.path={s['jsonl']}", "dataset.id_column=id", "dataset.prompt_column=prompt"]
    return ([] if "--dry-run" in out else ["--dry-run"]) + out + extra


COMMANDS = documented_commands()


def test_the_docs_show_the_commands_users_run_first():
    shown = {cmd for _, cmd in COMMANDS}
    assert "./launch.sh" in shown and "./launch.sh --help" in shown
    assert any("conf=flux2_tp" in c for c in shown) and any(c.startswith("./launch.sh conf=/") for c in shown)
    assert len(COMMANDS) >= 10, COMMANDS


@pytest.mark.parametrize(("where", "cmd"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_each_documented_command_dry_runs(where, cmd, stand_ins, launcher_main, capsys):
    args = localized(cmd, stand_ins, COMMANDS.index((where, cmd)))
    code = launcher_main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 0, f"{where}: {cmd} -> exit {code}: {err[-1] if err else ''}"
