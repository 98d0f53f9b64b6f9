"""A grid of a run's first samples, each captioned with its prompt:
`python tools/contact_sheet.py OUTPUT_DIR [--n N] [--cols C] [--out PATH]` (default OUTPUT_DIR/contact_sheet.png).

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

from launcher.host.card import open_run, shard_name, summarize, write_output
from launcher.ledger.states import DATA_DIR, IMAGES_DIR
from launcher.ledger.store import Store
from launcher.worker.encode import EXTENSIONS

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


def first_samples(run: Store, n: int) -> list[tuple[str, bytes]]:
    """(caption, image bytes) of the first n samples of the done shards, in shard and row order.

    That is id order for the default ids (row numbers), and it lets us stop reading as soon as we have n,
    which matters when a shard's Parquet file holds hundreds of megapixel images.
    """
    found: list[tuple[str, bytes]] = []
    parquet = {i.base_name for i in run.files(DATA_DIR, ".parquet")}
    summary = summarize(run)
    ext = "." + EXTENSIONS[summary["meta"]["config"]["output"].get("format", "png")]
    sweep = swept_keys(run)
    columns = ["prompt", "image"] if not sweep else [*{"prompt", "image", "variant", *_columns(sweep)}]
    for shard in summary["shards"]:
        if len(found) >= n:
            break
        if shard["status"] != "done":
            continue
        name = shard_name(shard["index"])
        if f"{name}.parquet" in parquet:
            pf = run.parquet(f"{DATA_DIR}/{name}.parquet")
            for batch in pf.iter_batches(batch_size=max(n - len(found), 1), columns=columns):
                found += [(caption(r, sweep), r["image"]["bytes"]) for r in batch.to_pylist()]
                if len(found) >= n:
                    break
        else:
            for info in run.files(f"{IMAGES_DIR}/{name}", ext)[: n - len(found)]:
                image = run.read_bytes(f"{IMAGES_DIR}/{name}/{info.base_name}")
                found.append((f"id {info.base_name.removesuffix(ext)}", image))
    return found[:n]


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


def cell_origin(i: int, cols: int) -> tuple[int, int]:
    return (i % cols) * CELL_W, (i // cols) * CELL_H


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
    sheet = Image.new("RGB", (cols * CELL_W, math.ceil(len(samples) / cols) * CELL_H), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default(size=FONT_SIZE)
    for i, (caption, png) in enumerate(samples):
        image = Image.open(io.BytesIO(png)).convert("RGB")
        scale = THUMB / max(image.size)
        # Nearest when enlarging keeps small images' pixels crisp (and exact); Lanczos when shrinking.
        resample = Image.Resampling.NEAREST if scale >= 1 else Image.Resampling.LANCZOS
        thumb = image.resize((round(image.width * scale), round(image.height * scale)), resample)
        x, y = cell_origin(i, cols)
        sheet.paste(thumb, (x + PAD + (THUMB - thumb.width) // 2, y + PAD + (THUMB - thumb.height) // 2))
        for k, line in enumerate(wrap(caption, font, THUMB, CAPTION_LINES)):
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
    except (FileNotFoundError, NotImplementedError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(write_output(args.output_dir, "contact_sheet.png", png_bytes(sheet), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
