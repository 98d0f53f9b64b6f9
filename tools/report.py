"""One self-contained HTML page about a run: `python tools/report.py OUTPUT_DIR [--out PATH]`.

The summary, a table of the shards, a plot of each shard's throughput over the run, and a contact sheet, all in
one file with no external references (the plot is inline SVG, the sheet a data: URL), so it can be mailed or
attached to an issue. Reads only the run folder; default output OUTPUT_DIR/report.html.
"""

from __future__ import annotations

import argparse
import base64
import sys
import time
from html import escape
from pathlib import Path

from contact_sheet import contact_sheet, png_bytes

from launcher.errors import ConfigError
from launcher.host.card import open_run, summarize, write_output

W, H, LEFT, BOTTOM, TOP, RIGHT = 720, 260, 56, 40, 16, 16
STYLE = """body{font:14px system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td.text,th{text-align:left}tr.failed{background:#fde8e8}tr.pending{color:#888}
.error{font-family:monospace;font-size:12px;max-width:480px;overflow-wrap:anywhere}"""


def fmt(x, digits: int = 3) -> str:
    return "" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def when(t: float | None) -> str:
    return "" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def throughput_svg(shards: list[dict], time_source: str) -> str:
    """Images/s of each done shard against when it finished (seconds since the first shard started).

    Without finish times (no `finished_at`, no file times) x falls back to the shard index. Failed shards are
    red ticks on the x axis, so a burst of failures shows where it happened.
    """
    timed = all(s["finished_at"] is not None for s in shards if s["status"] != "pending")
    if timed and any(s["finished_at"] is not None for s in shards):
        t0 = min(s["finished_at"] - (s["seconds"] or 0) for s in shards if s["finished_at"] is not None)
        xs = {s["index"]: s["finished_at"] - t0 for s in shards if s["finished_at"] is not None}
        xlabel = f"seconds since the first shard started (from {time_source})"
    else:
        xs = {s["index"]: float(s["index"]) for s in shards}
        xlabel = "shard index (finish times not recorded)"
    done = sorted((xs[s["index"]], s["images_per_s"], s["index"]) for s in shards if s["images_per_s"] is not None)
    failed = [(xs[s["index"]], s["index"]) for s in shards if s["status"] == "failed" and s["index"] in xs]
    xmax = max([x for x, *_ in done] + [x for x, _ in failed] + [1e-9])
    ymax = max([y for _, y, _ in done] + [1e-9]) * 1.1

    def px(x: float) -> float:
        return LEFT + x / xmax * (W - LEFT - RIGHT)

    def py(y: float) -> float:
        return H - BOTTOM - y / ymax * (H - BOTTOM - TOP)

    parts = [
        f'<svg width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img">',
        f'<line x1="{LEFT}" y1="{H - BOTTOM}" x2="{W - RIGHT}" y2="{H - BOTTOM}" stroke="#444"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{H - BOTTOM}" stroke="#444"/>',
        f'<text x="{LEFT - 6}" y="{TOP + 10}" text-anchor="end" font-size="11">{ymax:.3g}</text>',
        f'<text x="{LEFT - 6}" y="{H - BOTTOM}" text-anchor="end" font-size="11">0</text>',
        f'<text x="{W - RIGHT}" y="{H - BOTTOM + 14}" text-anchor="end" font-size="11">{xmax:.4g}</text>',
        f'<text x="{(W + LEFT) / 2}" y="{H - 8}" text-anchor="middle" font-size="12">{escape(xlabel)}</text>',
        f'<text x="14" y="{(H - BOTTOM + TOP) / 2}" font-size="12" text-anchor="middle" '
        f'transform="rotate(-90 14 {(H - BOTTOM + TOP) / 2})">images/s</text>',
    ]
    if len(done) > 1:
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y, _ in done)
        parts.append(f'<polyline points="{points}" fill="none" stroke="#4a7bd0" stroke-width="1.5"/>')
    parts += [
        f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="#1f4fa8"><title>shard {i}: {y} images/s</title>'
        "</circle>"
        for x, y, i in done
    ]
    parts += [
        f'<line x1="{px(x):.1f}" y1="{H - BOTTOM - 6}" x2="{px(x):.1f}" y2="{H - BOTTOM + 6}" stroke="#d03030" '
        f'stroke-width="2"><title>shard {i} failed</title></line>'
        for x, i in failed
    ]
    return "\n".join([*parts, "</svg>"])


def shard_rows(shards: list[dict]) -> list[str]:
    rows = []
    for s in shards:
        stages = ", ".join(f"{k} {v:.2f}s" for k, v in s["stages"].items() if v)  # most runs never warm up
        cells = [s["index"], s["status"], s["rows"], fmt(s["seconds"]), fmt(s["images_per_s"])]
        tds = "".join(f"<td>{escape(str(c if c is not None else ''))}</td>" for c in cells)
        tds += f'<td class="text">{when(s["finished_at"])}</td><td class="text">{escape(stages)}</td>'
        tds += f'<td class="text error">{escape(s["error"])}</td>'
        rows.append(f'<tr class="{escape(s["status"])}">{tds}</tr>')
    return rows


def report_html(out: str | Path, n: int = 16, cols: int = 4) -> str:
    summary = summarize(open_run(out))
    meta, counts, shards = summary["meta"], summary["counts"], summary["shards"]
    cfg = meta["config"]
    stage_totals: dict[str, float] = {}
    for s in shards:
        for k, v in s["stages"].items():
            stage_totals[k] = stage_totals.get(k, 0.0) + v
    facts = [
        ("run", f"{cfg['name']} in {out}"),
        ("model", f"{cfg['model']['path']} ({cfg['model']['dtype']})"),
        ("license", cfg["model"].get("license") or "not stated"),
        ("settings", ", ".join(f"{k}={v}" for k, v in meta["settings"]["generate"].items())),
        ("mesh", f"dp={cfg['mesh']['dp']} x tp={cfg['mesh']['tp']} on {cfg['device']}"),
        ("shards", f"{len(shards)}: {counts['done']} done, {counts['failed']} failed, {counts['pending']} pending"),
        ("images", summary["images"]),
        ("shard seconds (sum)", fmt(summary["seconds"])),
        ("images/s (per shard-second)", fmt(summary["images_per_s"])),
        ("first start to last finish", f"{fmt(summary['span_seconds'])} s" if summary["span_seconds"] else ""),
        ("time per stage (sum)", ", ".join(f"{k} {v:.2f}s" for k, v in stage_totals.items() if v)),
    ]
    try:
        sheet = base64.b64encode(png_bytes(contact_sheet(out, n, cols))).decode()
        sheet_html = f'<img alt="the first {n} samples" src="data:image/png;base64,{sheet}">'
    except ValueError as e:
        sheet_html = f"<p>{escape(str(e))}</p>"
    head = "".join(f"<th>{h}</th>" for h in ("shard", "status", "rows", "seconds", "images/s"))
    head += "".join(f"<th>{h}</th>" for h in ("finished", "stages", "error"))
    return "\n".join(
        [
            "<!doctype html>",
            f'<html><head><meta charset="utf-8"><title>meshgen report: {escape(cfg["name"])}</title>',
            f"<style>{STYLE}</style></head><body>",
            f"<h1>meshgen report: {escape(cfg['name'])}</h1>",
            '<table class="summary">',
            *[f'<tr><th>{escape(k)}</th><td class="text">{escape(str(v))}</td></tr>' for k, v in facts if v != ""],
            "</table>",
            "<h2>Throughput per shard</h2>",
            throughput_svg(shards, summary["time_source"]),
            "<h2>Samples</h2>",
            sheet_html,
            "<h2>Shards</h2>",
            f'<table class="shards"><thead><tr>{head}</tr></thead><tbody>',
            *shard_rows(shards),
            "</tbody></table>",
            f"<p>Generated {when(time.time())} from {escape(str(out))}.</p>",
            "</body></html>",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", help="the run folder: a local path, gs://... or s3://...")
    parser.add_argument("--out", type=Path, help="where to write the page (default OUTPUT_DIR/report.html)")
    args = parser.parse_args(argv)
    try:
        page = report_html(args.output_dir)
    except (FileNotFoundError, NotImplementedError, ConfigError) as e:  # ConfigError: credentials in the address
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(write_output(args.output_dir, "report.html", page.encode(), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
