"""The dataset card, contact sheet and HTML report, on the tiny tp=2 run (read only) or on copies of it."""

import base64
import html
import importlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import warnings
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO, pixels, read_rows
from PIL import Image

from launcher.publish.card import write_card

VOID = {"meta", "img", "br", "hr", "input", "link"}


@pytest.fixture
def tools(monkeypatch):
    """The tools' modules, imported the way `python tools/x.py` finds them (the script's folder on the path)."""
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    return importlib.import_module("contact_sheet"), importlib.import_module("report")


def copy_run(out, dest):
    shutil.copytree(out, dest, ignore=shutil.ignore_patterns("locks"))
    return dest


def edit_state(out, index: int, **changes):
    path = out / "state" / f"shard-{index:05d}.json"
    state = json.loads(path.read_text())
    state.update(changes)
    path.write_text(json.dumps(state))


def pixels_of(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB")).astype(np.int16)


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_card_front_matter_loads_the_run_as_an_image_dataset(run_job, tmp_path, caplog):
    import datasets

    out = copy_run(run_job(), tmp_path / "run")
    card = Path(write_card(out)).read_text()
    mtime = (out / "README.md").stat().st_mtime_ns
    assert Path(write_card(out)).stat().st_mtime_ns == mtime  # nothing new: not rewritten
    front = front_matter(card)
    assert {"name": "image", "dtype": "image"} in front["dataset_info"]["features"]
    assert {"name": "prompt", "dtype": "string"} in front["dataset_info"]["features"]
    [split] = front["dataset_info"]["splits"]
    assert (split["name"], split["num_examples"]) == ("train", 20)
    parquet = sorted((out / "data").glob("*.parquet"))
    assert front["dataset_info"]["download_size"] == sum(f.stat().st_size for f in parquet)
    assert front["dataset_info"]["dataset_size"] == split["num_bytes"] > 0
    assert front["size_categories"] == ["n<1K"]
    assert "row groups of 64 rows" in card
    # the default run stores each image once, in the Parquet (issue 35): the card says so, and names no files
    assert "png (lossless, zlib level 1), stored as the `image` column's bytes\n" in card
    [config] = front["configs"]
    assert config["data_files"] == [{"split": "train", "path": "data/*.parquet"}]
    assert front["license"] == "other" and front["license_name"] == "random-weights-no-license-restrictions"
    body = card.split("---\n", 2)[2]
    run = json.loads((out / "run.json").read_text())
    for fact in ("a local pipeline", "float32", "num_inference_steps: 4", "3 done, 0 failed, 0 pending"):
        assert fact in body
    assert run["config"]["model"]["path"] not in body and str(out) not in body  # the card names no local path
    assert "20 images" in body and "random weights, no license restrictions" in body

    files = str(out / config["data_files"][0]["path"])
    ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "cache"))
    assert isinstance(ds.features["image"], datasets.Image) and len(ds) == 20
    assert ds[0]["image"].size == (64, 64)
    # num_bytes comes from the files' footers; `datasets` counts the Arrow data it builds: they agree within 5%.
    assert abs(ds.info.splits["train"].num_bytes - split["num_bytes"]) < 0.05 * split["num_bytes"]
    # Loading the folder itself reads the card: its configs pick the files, and `datasets` checks num_examples.
    # It must say nothing: no warning (Python's or a log record) about the card.
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        ds = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "cache2"))
    assert not [str(w.message) for w in caught]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(ds) == 20 and isinstance(ds.features["image"], datasets.Image)
    assert ds.info.splits["train"].num_examples == 20


def test_card_of_an_unfinished_run_names_only_the_done_shards(run_job, tmp_path):
    import datasets

    out = copy_run(run_job(), tmp_path / "run")
    edit_state(out, 1, status="failed", error="RuntimeError: boom", images_per_s=None)
    (out / "state" / "shard-00002.json").unlink()
    res = subprocess.run([sys.executable, "-m", "launcher.publish.card", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    card = (out / "README.md").read_text()
    front = front_matter(card)
    assert front["configs"][0]["data_files"] == [{"split": "train", "path": "data/shard-00000.parquet"}]
    assert front["dataset_info"]["splits"][0]["num_examples"] == 8
    assert "1 done, 1 failed, 1 pending" in card and "not complete" in card
    ds = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "cache"))
    assert sorted(ds["id"], key=int) == [str(i) for i in range(8)]


def test_contact_sheet_shows_the_first_samples_with_captions(run_job, tools):
    cs, _ = tools
    out = run_job()
    rows = read_rows(out)
    sheet = cs.contact_sheet(out, n=5, cols=3)
    assert sheet.size == (3 * cs.CELL_W, 2 * cs.CELL_H)
    for i in range(6):
        x, y = cs.cell_origin(i, 3)
        thumb = sheet.crop((x + cs.PAD, y + cs.PAD, x + cs.PAD + cs.THUMB, y + cs.PAD + cs.THUMB))
        caption = pixels_of(sheet.crop((x, y + cs.PAD + cs.THUMB, x + cs.CELL_W, y + cs.CELL_H)))
        if i < 5:  # the 64x64 image enlarged 3x with nearest: shrinking it back gives the original pixels
            small = thumb.resize((64, 64), Image.Resampling.NEAREST)
            assert (pixels_of(small) == pixels(rows[str(i)]["image"]["bytes"])).all(), i
            assert (caption < 100).any(axis=-1).sum() > 50, f"cell {i} has no caption text"
        else:  # the grid's spare cell stays empty
            assert (pixels_of(thumb) == 255).all() and (caption == 255).all()
    # Asking for more than the run holds gives all of it.
    assert cs.contact_sheet(out, n=100, cols=8).size == (8 * cs.CELL_W, 3 * cs.CELL_H)


def test_captions_wrap_and_are_cut_to_three_lines(tools):
    from PIL import ImageFont

    cs, _ = tools
    font = ImageFont.load_default(size=cs.FONT_SIZE)
    lines = cs.wrap("a very long prompt about " + "many things " * 40 + "Supercalifragilistic" * 5, font, 150, 3)
    assert len(lines) == 3 and lines[-1].endswith("...")
    assert all(font.getlength(line) <= 150 for line in lines)
    assert cs.wrap("a red fox", font, 150, 3) == ["a red fox"]
    assert all(font.getlength(line) <= 60 for line in cs.wrap("Supercalifragilistic", font, 60, 5))


def test_contact_sheet_cli_writes_the_png(run_job, tmp_path, tools):
    cs, _ = tools
    dest = tmp_path / "sheet.png"
    cmd = [sys.executable, "tools/contact_sheet.py", str(run_job()), "--n", "4", "--cols", "2", "--out", str(dest)]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    image = Image.open(dest)
    assert image.format == "PNG" and image.size == (2 * cs.CELL_W, 2 * cs.CELL_H)
    assert len(np.unique(pixels_of(image).reshape(-1, 3), axis=0)) > 100


def test_finish_times_fall_back_to_the_state_files_times(run_job, tmp_path):
    from launcher.publish.card import open_run, summarize

    out = copy_run(run_job(), tmp_path / "run")
    for i in range(3):
        path = out / "state" / f"shard-{i:05d}.json"
        state = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("finished_at", "stages")}
        path.write_text(json.dumps(state))
        os.utime(path, (1000.0 + i, 1000.0 + i))
    summary = summarize(open_run(out))
    assert summary["time_source"] == "state file mtime"
    assert [s["finished_at"] for s in summary["shards"]] == [1000.0, 1001.0, 1002.0]
    assert summary["counts"] == {"done": 3, "failed": 0, "pending": 0} and summary["images"] == 20
    assert all(s["stages"] == {} for s in summary["shards"])


class Page(HTMLParser):
    """Collects each table's body rows (`tables[class]`; `rows`: the shard table's), the SVG's titles, circles and
    lines, the images, and unclosed tags."""

    def __init__(self, text: str):
        super().__init__()
        self.stack, self.titles, self.circles, self.imgs, self.urls = [], [], [], [], []
        self.tables, self.table, self.polylines = {}, None, 0
        self.feed(text)
        self.close()
        self.rows = self.tables.get("shards", [])

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.urls += [v for k, v in attrs.items() if k in ("src", "href") and not v.startswith("data:")]
        if tag == "table":
            self.table = attrs.get("class")
        if tag == "tr" and "tbody" in self.stack:
            self.tables.setdefault(self.table, []).append({"status": attrs.get("class"), "cells": []})
        elif tag == "td" and "tbody" in self.stack:
            self.tables[self.table][-1]["cells"].append("")
        elif tag == "polyline":
            self.polylines += 1
        elif tag == "circle":
            self.circles.append(float(attrs["cx"]))
        elif tag == "img":
            self.imgs.append(attrs["src"])
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack.pop() == tag, f"</{tag}> closes nothing open"

    def handle_data(self, data):
        if self.stack[-1:] == ["td"] and "tbody" in self.stack:
            self.tables[self.table][-1]["cells"][-1] += data
        elif self.stack[-1:] == ["title"] and "svg" in self.stack:
            self.titles.append(data)


def sheet_of(page: Page) -> Image.Image:
    [src] = page.imgs
    assert src.startswith("data:image/png;base64,")
    image = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
    assert image.format == "PNG"
    image.load()  # decodes all of it: a truncated PNG fails here
    return image


def test_report_of_the_run(run_job, tools):
    cs, report = tools
    page = Page(report.report_html(run_job()))
    assert page.stack == [] and page.urls == []
    assert [(r["status"], r["cells"][:3]) for r in page.rows] == [
        ("done", ["0", "done", "8"]),
        ("done", ["1", "done", "8"]),
        ("done", ["2", "done", "4"]),
    ]
    assert len(page.circles) == 3 and "shard 1: " in " ".join(page.titles)
    sheet = sheet_of(page)
    assert sheet.size == (4 * cs.CELL_W, 4 * cs.CELL_H)
    assert (pixels_of(sheet) == pixels_of(cs.contact_sheet(run_job(), 16, 4))).all()


def test_report_shows_failures_and_timings(run_job, tmp_path, tools):
    cs, _ = tools
    out = copy_run(run_job(), tmp_path / "run")
    # A second run, stopped: it failed shard 1 (its traceback's last line is the exception's own message).
    [first] = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    second = {**first, "run_id": "20990101T000000-host-1", "start": "2099-01-01T00:00:00", "exit_code": 3}
    second.update(images=0, seconds=4.0, images_per_s=0.0, command=["/x/launch.sh", "conf=tiny", "generate.seed=0"])
    (out / "runs" / "20990101T000000-host-1.json").write_text(json.dumps(second))
    trace = "Traceback (most recent call last):\n  File x\nValueError: the real cause"
    edit_state(out, 1, status="failed", error="RuntimeError: boom", images_per_s=None, finished_at=1000.0)
    edit_state(out, 1, traceback=trace, run_id=second["run_id"])
    edit_state(out, 0, finished_at=1020.0, stages={"generate": 1.5, "write": 0.25})
    edit_state(out, 2, finished_at=1010.0, stages={"generate": 0.5, "write": 0.25})
    res = subprocess.run([sys.executable, "tools/report.py", str(out)], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    text = (out / "report.html").read_text()
    page = Page(text)
    assert page.stack == [] and page.urls == [] and "http" not in text
    statuses = [(r["status"], r["cells"][1]) for r in page.rows]
    assert statuses == [("done", "done"), ("failed", "failed"), ("done", "done")]
    assert page.rows[1]["cells"][-1] == "RuntimeError: boom" and page.rows[0]["cells"][-1] == ""
    assert page.rows[0]["cells"][6] == "generate 1.50s, write 0.25s"
    assert "seconds since the first shard started (from finished_at)" in text
    # x is the finish time: shard 2 finished before shard 0; the failed shard is marked, not plotted.
    assert len(page.circles) == 2 and page.circles[0] < page.circles[1]
    assert "shard 2: " in page.titles[0] and "shard 1 failed" in page.titles
    assert "generate 2.00s, write 0.50s" in text  # the stage totals
    # The runs as the terminal summed them up, with exit codes and commands; the failure and how to rerun it.
    runs = page.tables["runs"]
    assert [(r["cells"][0], r["cells"][2]) for r in runs] == [(first["run_id"], "0"), (second["run_id"], "3")]
    assert (
        runs[0]["cells"][5] == str(first["images_per_s"])
        and runs[1]["cells"][-1] == "/x/launch.sh conf=tiny generate.seed=0"
    )
    assert "0 images in 4.0 s (0.0 images/s), exit 3" in text  # the last run's own figures, as its terminal said
    total = first["seconds"] + 4.0
    assert f"{first['images']} images in {total:.1f} s of wall time ({first['images'] / total:.3f} images/s)" in text
    [failure] = page.tables["failures"]
    assert failure["cells"] == ["1", "ValueError: the real cause"]
    assert f"/x/launch.sh conf=tiny generate.seed=0 output.dir={out} 'run.shards=[1]'</pre>" in html.unescape(text)
    assert page.polylines == 1  # shards 0 and 2, of the first run: one line; none to another run's shards
    # 12 samples from the two done shards: 3 rows of 4.
    assert sheet_of(page).size == (4 * cs.CELL_W, 3 * cs.CELL_H)
