"""A grid of a run's first samples, each captioned with its prompt:
`python tools/contact_sheet.py OUTPUT_DIR [--n N] [--cols C] [--out PATH]` (default OUTPUT_DIR/contact_sheet.png).
An edit run (job=edit) shows before | after pairs: its first reference beside each image.

Reads only the run folder: the state files say which shards are done, their Parquet files hold the images and
prompts (a shard written with output.parquet=false falls back to its PNG files, captioned with the ids).
A sweep's sheet is a grid per prompt: one row per prompt (or per image of a prompt), one column per variant,
each captioned with its swept values (whole rows: at least one, --n images when it holds enough of them).
"""

from __future__ import annotations

import argparse
import io
import math
import sys
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from launcher.errors import ConfigError, error_line
from launcher.ledger.states import DATA_DIR, IMAGES_DIR
from launcher.ledger.store import Store
from launcher.publish.card import open_run, shard_name, summarize, write_output
from launcher.writer.encode import EXTENSIONS

THUMB = 192  # each image is fitted into a THUMB x THUMB square
PAD = 8
FONT_SIZE = 13
LINE_H = FONT_SIZE + 4
CAPTION_LINES = 3
CELL_W = THUMB + 2 * PAD
CELL_H = THUMB + 2 * PAD + CAPTION_LINES * LINE_H
BACKGROUND = (255, 255, 255)


def swept_keys(run: Store) -> dict[str, list]:
    """The run's sweep ({} without one), as its run.json records it."""
    return summarize(run)["meta"]["settings"].get("generate", {}).get("sweep") or {}


def caption(r: dict, sweep: dict) -> str:
    """A sample's caption: its prompt, or with a sweep its variant's values (the prompt first in its row)."""
    if not sweep:
        return r["prompt"]
    values = ", ".join(
        f"{k}={r['lora_scales'][int(k.split('.')[1])] if k.startswith('lora_scale.') else r[k]:g}" for k in sweep
    )
    return f"{r['prompt']} | @0 {values}" if r["variant"] == 0 else f"@{r['variant']} {values}"


def first_samples(run: Store, n: int) -> list[tuple]:
    """(caption, image bytes), or for an edit run (caption, image bytes, first reference's bytes), of the first n
    samples of the done shards, in shard and row order.

    That is id order for the default ids (row numbers), and it lets us stop reading as soon as we have n,
    which matters when a shard's Parquet file holds hundreds of megapixel images.
    """
    found: list[tuple[str, bytes]] = []
    parquet = {i.base_name for i in run.files(DATA_DIR, ".parquet")}
    summary = summarize(run)
    config = summary["meta"]["config"]
    ext = "." + EXTENSIONS[config["output"].get("format", "png")]
    edit = config.get("job") == "edit"
    sweep = swept_keys(run)
    wanted = ["prompt", "image"] if not sweep else [*{"prompt", "image", "variant", *_columns(sweep)}]
    for shard in summary["shards"]:
        if len(found) >= n:
            break
        if shard["status"] != "done":
            continue
        name = shard_name(shard["index"])
        if f"{name}.parquet" in parquet:
            pf = run.parquet(f"{DATA_DIR}/{name}.parquet")
            columns = wanted + (["reference"] if edit else [])
            columns += ["reference_image"] if edit and "reference_image" in pf.schema_arrow.names else []
            for batch in pf.iter_batches(batch_size=max(n - len(found), 1), columns=columns):
                rows = batch.to_pylist()
                found += [(caption(r, sweep), r["image"]["bytes"], *_before(r, config)) for r in rows]
                if len(found) >= n:
                    break
        else:
            for info in run.files(f"{IMAGES_DIR}/{name}", ext)[: n - len(found)]:
                image = run.read_bytes(f"{IMAGES_DIR}/{name}/{info.base_name}")
                found.append((f"id {info.base_name.removesuffix(ext)}", image))
    return found[:n]


def _before(row: dict, config: dict) -> tuple:
    """An edit sample's first reference: kept in the row (output.reference_bytes), else read from its lineage."""
    if "reference" not in row:
        return ()
    if row.get("reference_image"):
        return (row["reference_image"]["bytes"],)
    from launcher.sources.reference_reads import read_lineage

    return (read_lineage(row["reference"][0]["path"], config["dataset"].get("image_column", "image")),)


def pair(before: bytes, after: bytes) -> Image.Image:
    """before | after, side by side at the after image's height."""
    b, a = (Image.open(io.BytesIO(x)).convert("RGB") for x in (before, after))
    b = b.resize((max(1, round(b.width * a.height / b.height)), a.height), Image.Resampling.LANCZOS)
    out = Image.new("RGB", (b.width + a.width, a.height), BACKGROUND)
    out.paste(b, (0, 0))
    out.paste(a, (b.width, 0))
    return out


def _columns(sweep: dict) -> list[str]:
    return ["lora_scales" if k.startswith("lora_scale.") else k for k in sweep]


def wrap(text: str, font: ImageFont.ImageFont, width: int, lines: int) -> list[str]:
    """Greedy word wrap to `width` pixels, at most `lines` lines, the last one cut with '...' if text remains."""
    out, line = [], ""
    for word in text.split():
        candidate = f"{line} {word}".strip()
        if font.getlength(candidate) <= width:
            line = candidate
            continue
        if line:
            out.append(line)
        line = word
        while font.getlength(line) > width:  # a word wider than the cell: break it
            cut = 1
            while font.getlength(line[: cut + 1]) <= width:
                cut += 1
            out.append(line[:cut])
            line = line[cut:]
    if line:
        out.append(line)
    if len(out) > lines:
        last = out[lines - 1]
        while last and font.getlength(last + "...") > width:
            last = last[:-1]
        out = [*out[: lines - 1], last.rstrip() + "..."]
    return out


def cell_origin(i: int, cols: int, thumb_w: int = THUMB) -> tuple[int, int]:
    return (i % cols) * (thumb_w + 2 * PAD), (i // cols) * CELL_H


def contact_sheet(out: str | Path, n: int = 16, cols: int = 4) -> Image.Image:
    """The grid of the first n samples (fewer if the run has fewer), `cols` wide; ValueError if it has none.

    With a sweep of V variants: rows of a prompt's V samples, in order, V wide (n // V rows, at least one)."""
    run = open_run(out)
    sweep = swept_keys(run)
    if sweep:
        cols = math.prod(len(v) for v in sweep.values())
        n = max(1, n // cols) * cols
    samples = first_samples(run, n)
    if not samples:
        raise ValueError(f"{out} has no done shards with images yet")
    cols = max(1, min(cols, len(samples)))
    thumb_w = THUMB * (2 if len(samples[0]) == 3 else 1)  # an edit run's cells hold before | after
    sheet = Image.new("RGB", (cols * (thumb_w + 2 * PAD), math.ceil(len(samples) / cols) * CELL_H), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default(size=FONT_SIZE)
    for i, (caption, png, *before) in enumerate(samples):
        image = pair(before[0], png) if before else Image.open(io.BytesIO(png)).convert("RGB")
        scale = min(thumb_w / image.width, THUMB / image.height)
        # Nearest when enlarging keeps small images' pixels crisp (and exact); Lanczos when shrinking.
        resample = Image.Resampling.NEAREST if scale >= 1 else Image.Resampling.LANCZOS
        thumb = image.resize((round(image.width * scale), round(image.height * scale)), resample)
        x, y = cell_origin(i, cols, thumb_w)
        sheet.paste(thumb, (x + PAD + (thumb_w - thumb.width) // 2, y + PAD + (THUMB - thumb.height) // 2))
        for k, line in enumerate(wrap(caption, font, thumb_w, CAPTION_LINES)):
            draw.text((x + PAD, y + THUMB + PAD + PAD // 2 + k * LINE_H), line, fill=(20, 20, 20), font=font)
    return sheet


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", help="the run folder: a local path, gs://... or s3://...")
    parser.add_argument("--n", type=int, default=16, help="how many samples (default 16)")
    parser.add_argument("--cols", type=int, default=4, help="images per row (default 4)")
    parser.add_argument("--out", type=Path, help="where to write the PNG (default OUTPUT_DIR/contact_sheet.png)")
    args = parser.parse_args(argv)
    try:
        sheet = contact_sheet(args.output_dir, args.n, args.cols)
    except (FileNotFoundError, NotImplementedError, ValueError, ConfigError) as e:
        print(error_line(e), file=sys.stderr)
        return 2
    print(write_output(args.output_dir, "contact_sheet.png", png_bytes(sheet), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
