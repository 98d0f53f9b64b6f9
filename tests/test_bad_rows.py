"""A bad row costs one row (issue 34): every check a row can fail runs at planning, in both readers and every source
format; `dataset.bad_rows=refuse` names the row (exit 2), `skip` sets it aside in rejected/<run id>.parquet and
generates the rest; a set-aside row that is fixed is generated later without any shard going stale."""

from __future__ import annotations

import importlib
import io
import json
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import launch, read_rows
from PIL import Image

from launcher.errors import ConfigError
from launcher.sources.prompts import SizeRule, Source, read_batches

LONG_ID = "x" * 300


def write_source(folder: Path, fmt: str, rows: list[dict]) -> Path:
    """The rows (id, prompt) as a source of format `fmt`; a None value is a missing (null) cell."""
    if fmt == "jsonl":
        path = folder / "p.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "csv":
        path = folder / "p.csv"
        path.write_text("id,prompt\n" + "".join(f'"{r["id"] or ""}","{r["prompt"]}"\n' for r in rows))
    elif fmt == "parquet":
        path = folder / "p.parquet"
        pq.write_table(pa.Table.from_pylist(rows, pa.schema([("id", pa.string()), ("prompt", pa.string())])), path)
    else:
        import datasets

        path = folder / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def where(path: Path, fmt: str, k: int = 1) -> str:
    """How a message names row k (from 0) of a source: its line in a text file (after a CSV's header), its row in
    an Arrow one."""
    return {"jsonl": f"{path}, line {k + 1}", "csv": f"{path}, line {k + 2}", "txt": f"{path}, line {k + 1}"}.get(
        fmt, f"{path}, row {k}"
    )


def rows_of(src: Source) -> list[dict]:
    return [r for b in read_batches(src) for r in b.to_pylist()]


BAD_IDS = {  # case: (the second row's id, what the refusal says)
    "too long": (LONG_ID, "300 bytes of UTF-8, more than the 200"),
    "empty": ("", "is empty"),
    "control character": ("a\x01b", "control character"),
    "null": (None, "missing (null)"),
}


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "save_to_disk"])
@pytest.mark.parametrize("case", sorted(BAD_IDS))
def test_an_id_that_cannot_name_a_file_is_refused_or_set_aside_in_every_format(fmt, case, tmp_path):
    bad, says = BAD_IDS[case]
    if fmt == "csv" and case == "null":
        pytest.skip("a CSV cell has no null: an empty cell is the empty case")
    rows = [{"id": "a", "prompt": "one"}, {"id": bad, "prompt": "two"}, {"id": "c", "prompt": "three"}]
    path = write_source(tmp_path, fmt, [*rows, {"id": bad, "prompt": "four"}])
    with pytest.raises(ConfigError) as e:
        rows_of(Source(str(path), id_column="id"))
    assert f"dataset {where(path, fmt)}: " in str(e.value) and says in str(e.value), str(e.value)
    assert "has no id column" not in str(e.value)  # a null id is no missing column
    rows = rows_of(Source(str(path), id_column="id", bad_rows="skip"))
    assert [r["id"] for r in rows if r["rejected"] is None] == ["a", "c"]
    assert says in json.loads(rows[1]["rejected"])["reason"] and rows[1]["prompt"] is None
    assert [json.loads(rows[k]["rejected"])["where"] for k in (1, 3)] == [
        f"dataset {where(path, fmt, k)}" for k in (1, 3)
    ]


def _invalid_utf8(values: list[bytes]) -> pa.Array:
    """A string array holding the bytes as they are (Parquet does not check that text is UTF-8)."""
    return pa.array(values, pa.binary()).view(pa.string())


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "csv", "parquet"])
def test_text_that_is_not_utf8_is_refused_at_planning_in_every_format(fmt, tmp_path):
    bad = "caf\xe9".encode("latin-1")
    path = tmp_path / f"p.{fmt}"
    if fmt == "txt":
        path.write_bytes(b"one\n" + bad + b"\nthree\n")
    elif fmt == "jsonl":
        path.write_bytes(b'{"prompt": "one"}\n{"prompt": "' + bad + b'"}\n{"prompt": "three"}\n')
    elif fmt == "csv":
        path.write_bytes(b"prompt\none\n" + bad + b"\nthree\n")
    else:
        pq.write_table(pa.table({"prompt": _invalid_utf8([b"one", bad, b"three"])}), path)
    with pytest.raises(ConfigError) as e:
        rows_of(Source(str(path)))
    assert where(path, fmt) in str(e.value) and "UTF-8" in str(e.value), str(e.value)
    rows = rows_of(Source(str(path), bad_rows="skip"))
    assert [r["prompt"] for r in rows] == ["one", None, "three"] and [r["id"] for r in rows] == ["0", "1", "2"]
    assert "UTF-8" in json.loads(rows[1]["rejected"])["reason"]


def test_a_jsonl_row_that_is_not_utf8_never_reaches_the_plan_file(tmp_path):
    """The finding: JSONL passed planning and the worker's PlanFile.shard raised UnicodeDecodeError."""
    from launcher.sources.prompts_fast import fast_batches

    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "one"}\n{"prompt": "caf\xe9"}\n')
    from launcher.sources.prompts import _GiveUp

    with pytest.raises(_GiveUp):  # the fast reader does not pass it on: the exact one names the line
        list(fast_batches(str(path), Source(str(path)), 0))


PEAK = """
import resource, sys
sys.path.insert(0, {root!r})
from launcher.errors import ConfigError
from launcher.sources.prompts import Source, read_batches
def read(p):
    try:
        return sum(b.num_rows for b in read_batches(Source(p)))
    except ConfigError as e:
        return str(e)
read({small!r})
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
said = read({big!r})
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base, said)
"""


@pytest.mark.parametrize("fmt", ["jsonl", "txt", "csv"])
def test_a_line_far_over_the_limit_is_refused_while_it_is_read(fmt, tmp_path):
    """A 128 MB line: the readers stop holding it at the line bound (the finding: 1.6 GB peak for 300 MB)."""
    head = b"prompt\n" if fmt == "csv" else b""
    line = b'{"prompt": "' + b"a" * (128 << 20) + b'"}' if fmt == "jsonl" else b"a" * (128 << 20)
    small, big = tmp_path / f"s.{fmt}", tmp_path / f"b.{fmt}"
    small.write_bytes(head + b"ok\n" if fmt != "jsonl" else b'{"prompt": "ok"}\n')
    big.write_bytes(head + (b'{"prompt": "ok"}\n' if fmt == "jsonl" else b"ok\n") + line + b"\n")
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", PEAK.format(root=root, small=str(small), big=str(big))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    grew_kb, said = out.stdout.split(" ", 1)
    assert "longer than" in said and ("line 2" if fmt != "csv" else "line 3") in said, out.stdout + out.stderr
    assert int(grew_kb) < 64 * 1024, f"reading grew the peak by {int(grew_kb) >> 10} MB"


def _png(size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise(size, 60).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


RULE = SizeRule(16, 4 * 1024 * 1024, 64, 64, 10)  # FLUX.2's: 4 megapixels, 10 references
BAD_REFS = {  # case: (the second row's reference, what the refusal says)
    "cut short": ("cut.png", "cut short"),
    "smaller than the pipeline takes": ("small.png", "96x32"),
    "never ends": ("/dev/zero", "larger than"),
}


@pytest.mark.parametrize("case", sorted(BAD_REFS))
def test_a_reference_that_would_fail_its_shard_is_refused_or_set_aside_at_planning(case, tmp_path):
    (tmp_path / "ok.png").write_bytes(_png((64, 64)))
    (tmp_path / "cut.png").write_bytes(_png((256, 256))[:3000])  # a valid header, the data cut short
    (tmp_path / "small.png").write_bytes(_png((96, 32)))  # under FLUX.2's 64 px a side
    ref, says = BAD_REFS[case]
    rows = [{"prompt": "a", "image": "ok.png"}, {"prompt": "b", "image": ref}, {"prompt": "c", "image": "ok.png"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result: dict = {}

    def plan():  # in a thread: /dev/zero hashed forever before
        try:
            rows_of(Source(str(path), image_column="image", sizes=RULE))
        except ConfigError as e:
            result["error"] = str(e)
        result["skip"] = rows_of(Source(str(path), image_column="image", sizes=RULE, bad_rows="skip"))

    t = threading.Thread(target=plan, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "planning did not end"
    assert f"{path}, line 2" in result["error"] and says in result["error"], result["error"]
    got = result["skip"]
    assert [r["rejected"] is None for r in got] == [True, False, True]
    rejected = json.loads(got[1]["rejected"])  # where the row is, and why: the reason does not say where again
    assert rejected["where"] == f"dataset {path}, line 2" and says in rejected["reason"], rejected
    assert not rejected["reason"].startswith(("dataset", ":")), rejected
    assert got[0]["ref_sha256"] and got[2]["ref_sha256"]


def test_an_edit_rows_output_size_the_pipeline_would_refuse_is_refused_or_set_aside_at_planning(tmp_path):
    """The edit pipeline meets its references at the output size: under 64 px a side or past 8:1 it refuses them,
    so planning does, naming the row, whether the size is the row's own or the config's."""
    (tmp_path / "ok.png").write_bytes(_png((64, 64)))
    rows = [{"prompt": "a", "image": "ok.png"}, {"prompt": "b", "image": "ok.png", "height": 64, "width": 576}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config_size = SizeRule(16, 4 * 1024 * 1024, 48, 64, 10)  # a config height of 48: the first row's, unset
    with pytest.raises(ConfigError) as e:
        rows_of(Source(str(path), image_column="image", sizes=config_size))
    assert str(e.value).startswith(f"dataset {path}, line 1: ") and "64x48 here" in str(e.value), str(e.value)
    got = rows_of(Source(str(path), image_column="image", sizes=config_size, bad_rows="skip"))
    reasons = [json.loads(r["rejected"]) for r in got]
    assert [r["where"] for r in reasons] == [f"dataset {path}, line 1", f"dataset {path}, line 2"], reasons
    assert "64x48 here" in reasons[0]["reason"] and "576x64 here" in reasons[1]["reason"], reasons


@pytest.mark.parametrize(
    "override, says",
    [
        ("run.timeout_s=0", "run.timeout_s=0 must be at least 1"),
        ("run.shards=[]", "run.shards=[] selects no shards"),
        ("dataset.bad_rows=ignore", "dataset.bad_rows='ignore' is not one of refuse, skip"),
    ],
)
def test_settings_that_would_fail_or_do_nothing_are_refused_by_the_dry_run(
    override, says, launcher_main, tiny_model, tmp_path, capsys
):
    src = tmp_path / "p.txt"
    src.write_text("a\nb\n")
    args = ["--dry-run", f"model.path={tiny_model}", f"dataset.path={src}", f"output.dir={tmp_path / 'o'}", override]
    assert launcher_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_a_changed_reference_is_named_as_the_change(tmp_path):
    """The stale refusal of an edit shard whose instruction is the same and whose reference changed says so."""
    from types import SimpleNamespace

    from launcher.ledger.store import Store
    from launcher.plan.stale import refuse

    ref = pa.struct([("id", pa.string()), ("path", pa.string()), ("sha256", pa.string())])
    old = pa.table(
        {
            "id": ["a", "b"],
            "prompt": ["make it night", "make it day"],
            "reference": pa.array(
                [[{"id": "a", "path": "/r/a.png", "sha256": "1" * 64}]] * 1
                + [[{"id": "b", "path": "/r/b.png", "sha256": "2" * 64}]],
                pa.list_(ref),
            ),
        }
    )
    (tmp_path / "data").mkdir()
    pq.write_table(old, tmp_path / "data" / "shard-00000.parquet")
    now = pa.table({"id": ["a", "b"], "prompt": ["make it night", "make it day"], "ref_sha256": ["1" * 64, "3" * 64]})
    cfg = SimpleNamespace(dataset=SimpleNamespace(id_column="id"))
    with pytest.raises(ConfigError) as e:
        refuse(cfg, Store(tmp_path), [0], {0: now})
    assert "reference images changed (/r/b.png)" in str(e.value) and "prompts changed" not in str(e.value), str(e.value)


# The 10k-row source with 1% bad rows: one of each kind below every 100 rows, at row 100*k + 37.
KINDS = ["utf8", "long id", "null prompt", "empty id", "duplicate id", "control id", "json", "steps", "long prompt"]


def _line(i: int, fixed: set[int]) -> bytes:
    row = {"id": f"r{i}", "prompt": f"prompt {i}"}
    if i % 100 != 37 or i in fixed:
        return json.dumps(row).encode()
    kind = KINDS[(i // 100) % len(KINDS)]
    if kind == "utf8":
        return json.dumps(row).encode().replace(b"prompt ", b"caf\xe9 ")
    row.update(
        {
            "long id": {"id": LONG_ID + str(i)},
            "null prompt": {"prompt": None},
            "empty id": {"id": ""},
            "duplicate id": {"id": f"r{i - 1}"},
            "control id": {"id": f"r\x07{i}"},
            "steps": {"num_inference_steps": 0},
            "long prompt": {"prompt": "p" * (65 << 10)},
        }.get(kind, {})
    )
    return json.dumps(row).encode()[:-5] if kind == "json" else json.dumps(row).encode()


def _source(path: Path, fixed: set[int] = frozenset()) -> None:
    path.write_bytes(b"\n".join(_line(i, fixed) for i in range(10_000)) + b"\n")


SKIP_JOB = (
    "dataset.id_column=id",
    "dataset.bad_rows=skip",
    "run.shard_size=200",
    "generate.height=16",
    "generate.width=16",
    "generate.num_inference_steps=1",
    "mesh.tp=1",
)


@pytest.mark.parametrize("ids", [False, True])
def test_a_shard_whose_rows_are_all_set_aside_is_an_empty_shard_of_the_plan(tmp_path, ids):
    """DESIGN, `dataset.bad_rows=skip`: a set-aside row is never generated. Shards of 2 rows, the middle shard's
    two rows both bad: the plan file still holds that shard, with no row (the worker marks it done with none),
    and the shards on either side their good rows, with or without an id column."""
    from launcher.config import load_config
    from launcher.ledger.store import Store
    from launcher.plan.plan import PlanFile, make_plan, write_plan_file

    src = tmp_path / "p.jsonl"
    rows = [{"id": f"r{i}", "prompt": None if i in (2, 3) else f"prompt {i}"} for i in range(6)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = [f"dataset.path={src}", "dataset.bad_rows=skip", "run.shard_size=2", f"output.dir={tmp_path / 'out'}"]
    cfg = load_config("tiny", ["model.path=org/model", *job, *(["dataset.id_column=id"] if ids else [])])
    plan = make_plan(cfg, {})
    # the contract's sample ids: the id column's values, else each row's number in the source
    assert [r["id"] for r in plan.rejected] == (["r2", "r3"] if ids else ["2", "3"])
    store = Store(tmp_path / "scratch")
    write_plan_file(store, "plan.arrow", cfg, plan)
    file = PlanFile(store, "plan.arrow")
    shards = {i: [(r["id"], r["prompt"]) for r in file.shard(i).rows] for i in file.selected}
    if ids:  # shards of ids: the good ids fill shards in turn, and no shard is left empty
        assert shards == {0: [("r0", "prompt 0"), ("r1", "prompt 1")], 1: [("r4", "prompt 4"), ("r5", "prompt 5")]}
    else:  # shards of rows by position: the middle one keeps its place, empty
        assert shards == {0: [("0", "prompt 0"), ("1", "prompt 1")], 1: [], 2: [("4", "prompt 4"), ("5", "prompt 5")]}


def test_skip_sets_aside_one_percent_bad_rows_and_generates_every_good_row_once(tiny_model, tmp_path, monkeypatch):
    from launcher.config import load_config
    from launcher.ledger.store import Store
    from launcher.plan.plan import make_plan, write_plan_file

    src, out = tmp_path / "p.jsonl", tmp_path / "out"
    _source(src)
    bad = {i for i in range(10_000) if i % 100 == 37}
    job = [f"model.path={tiny_model}", f"dataset.path={src}", f"output.dir={out}", *SKIP_JOB]
    # Every good row is in the plan once, every bad row in none: the plan file of all 50 shards, read back.
    cfg = load_config("tiny", job)
    plan = make_plan(cfg, {})
    assert len(plan.shards) == 50 and len(plan.selected) == 50 and len(plan.rejected) == 100
    scratch = Store(tmp_path / "scratch")
    write_plan_file(scratch, "plan.arrow", cfg, plan)
    planned = pa.ipc.open_file(str(tmp_path / "scratch" / "plan.arrow")).read_all().column("id").to_pylist()
    assert sorted(planned) == sorted(f"r{i}" for i in range(10_000) if i not in bad)
    # A real launch of shard 0: with an id column a shard holds ids, so shard 0 is the first 200 good ids (bad rows 37
    # and 137 get none), and every bad row of the source is in rejected/<run id>.parquet with its reason.
    res = launch(*job, "run.shards=[0]", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "100 bad rows set aside" in res.stderr, res.stderr[-2000:]
    first = [f"r{i}" for i in range(202) if i not in bad]
    assert sorted(read_rows(out)) == sorted(first)
    (rejected,) = (out / "rejected").glob("*.parquet")
    got = pq.read_table(rejected).to_pylist()
    assert sorted(r["position"] for r in got) == sorted(bad)
    reasons = {KINDS[(r["position"] // 100) % len(KINDS)]: r["reason"] for r in got}
    for kind, words in {
        "utf8": "UTF-8",
        "long id": "200",
        "null prompt": "missing (null)",
        "empty id": "empty",
        "duplicate id": "duplicate id",
        "control id": "control character",
        "json": "malformed JSON",
        "steps": "num_inference_steps",
        "long prompt": "64 KiB",
    }.items():
        assert words in reasons[kind], (kind, reasons[kind])
    assert all(r["file"] == str(src) and r["line"] == r["position"] + 1 for r in got if "duplicate" not in r["reason"])
    record = json.loads(next((out / "runs").glob("*.json")).read_text())
    assert record["rejected"] == 100 and record["rejected_file"] == f"rejected/{rejected.name}"
    assert "| 100 |" in (out / "README.md").read_text()  # the card's runs table: rejected rows
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools"))
    page = importlib.import_module("report").report_html(out)
    assert f"100, with their reasons in rejected/{rejected.name}" in page
    # Fix two bad rows: ids never seen before go to a new shard (50, after the 49 full ones and the 100-row last),
    # the same job generates them there, and no shard is stale.
    _source(src, fixed={37, 137})
    res = launch(*job, "run.shards=[50]", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(read_rows(out)) == sorted([*first, "r37", "r137"])
    res = launch("--dry-run", *job)
    assert res.returncode == 0 and "2 done, 0 failed, 0 stale" in res.stdout, res.stdout + res.stderr[-2000:]


def test_skip_sets_aside_the_later_of_two_ids_that_make_one_file_name(tmp_path):
    """`a b` and `a_b` both become the file a_b.png: refuse names both, skip keeps the first and sets aside the other
    (found once every id is read, so planning reads the source again without it); an id twice is a duplicate,
    its later rows set aside naming the first's row."""
    from launcher.sources.rejected import Recheck

    ids = ("a b", "c", "a_b", "d", "c", "e", "c")
    path = write_source(tmp_path, "jsonl", [{"id": i, "prompt": i} for i in ids])
    with pytest.raises(ConfigError, match="'a b' and 'a_b' both become the file name a_b"):
        rows_of(Source(str(path), id_column="id"))
    with pytest.raises(Recheck) as again:
        rows_of(Source(str(path), id_column="id", bad_rows="skip"))
    rows = rows_of(Source(str(path), id_column="id", bad_rows="skip", late=again.value.late))
    assert [r["id"] for r in rows if r["rejected"] is None] == ["a b", "c", "d", "e"]
    reasons = {k: json.loads(r["rejected"])["reason"] for k, r in enumerate(rows) if r["rejected"] is not None}
    assert reasons == {
        2: "ids 'a b' (row 0) and 'a_b' both become the file name a_b; make them differ in letters, digits, '-' or '_'",
        4: "duplicate id 'c' (also row 1 of the source); ids must be unique",
        6: "duplicate id 'c' (also row 1 of the source); ids must be unique",
    }
