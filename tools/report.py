"""One self-contained HTML page about a run folder: `python tools/report.py OUTPUT_DIR [--out PATH]`.

The summary with the terminal's own figures (images/s over each run's wall time), the runs with their exit codes
and commands, the failed and damaged shards (as tools/status.py finds them) with their error's last line and the
command that reruns them, a plot of each shard's throughput (one line per run: no line across the idle time
between runs), a contact sheet and a table of the shards, all in one file with no external references (the plot
is inline SVG, the sheet a data: URL), so it can be mailed or attached to an issue. Reads only the run folder;
default output OUTPUT_DIR/report.html.
"""

from __future__ import annotations

import argparse
import base64
import shlex
import sys
import time
from html import escape
from pathlib import Path

from contact_sheet import contact_sheet, png_bytes
from status import rerun_command

from launcher.errors import ConfigError, error_line
from launcher.ledger.runs import read_records
from launcher.ledger.states import Ledger, read_state
from launcher.ledger.verify import listed_damage
from launcher.publish.card import open_run, summarize, write_output

W, H, LEFT, BOTTOM, TOP, RIGHT = 720, 260, 56, 40, 16, 16
STYLE = """body{font:14px system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td.text,th{text-align:left}tr.failed,tr.damaged{background:#fde8e8}tr.pending{color:#888}
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
    run_of = {s["index"]: s.get("run_id") for s in shards}
    for run in dict.fromkeys(run_of[i] for *_, i in done):  # one line per run: none across the gap between runs
        mine = [(x, y) for x, y, i in done if run_of[i] == run]
        if len(mine) > 1:
            points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in mine)
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
        status = "done, kept-stale" if s.get("kept_stale") else s["status"]  # run.stale=keep: old prompts' images
        cells = [s["index"], status, s["rows"], fmt(s["seconds"]), fmt(s["images_per_s"])]
        tds = "".join(f"<td>{escape(str(c if c is not None else ''))}</td>" for c in cells)
        tds += f'<td class="text">{when(s["finished_at"])}</td><td class="text">{escape(stages)}</td>'
        tds += f'<td class="text error">{escape(s["error"])}</td>'
        rows.append(f'<tr class="{escape(s["status"])}">{tds}</tr>')
    return rows


def run_rows(records: list[dict]) -> list[str]:
    """Each run as the terminal summed it up: wall time, images/s over it, its exit code and command."""
    rows = []
    for r in records:
        cells = [r.get("run_id", ""), r.get("start", ""), r.get("exit_code", ""), r.get("images", ""), r.get("seconds")]
        cells += [r.get("images_per_s"), r.get("generated", ""), r.get("startup_s"), r.get("rejected", 0)]
        tds = "".join(f"<td>{escape('' if c is None else str(c))}</td>" for c in cells)  # as the terminal said
        tds += f'<td class="text cmd">{escape(shlex.join(r.get("command") or []))}</td>'
        rows.append(f'<tr class="{"ok" if r.get("exit_code") == 0 else "failed"}">{tds}</tr>')
    return rows


def last_line(store, shard: dict) -> str:
    """The error's last line: the exception's own message, where the first line may be a wrapper's (the traceback
    is in the state file itself; the ledger's index keeps only the first line). A damaged shard: what is wrong."""
    if shard["status"] == "damaged":
        return shard["error"]
    state = read_state(store, shard["index"]) or {}
    lines = [ln for ln in (state.get("traceback") or shard["error"]).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def report_html(out: str | Path, n: int = 16, cols: int = 4) -> str:
    store = open_run(out)
    ledger = Ledger(store)
    states = ledger.refresh()
    summary = summarize(store, states)
    meta, counts, shards = summary["meta"], summary["counts"], summary["shards"]
    mark_damaged(shards, counts, ledger, listed_damage(store, states))
    records = read_records(store)
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
        (
            "shards",
            f"{len(shards)}: {counts['done']} done, {counts['failed']} failed, {counts['pending']} pending"
            + (f", {counts['damaged']} damaged" if counts["damaged"] else ""),
        ),
        ("images", summary["images"]),
        ("rows set aside (last run)", rejected_fact(records[-1]) if records and records[-1].get("rejected") else ""),
        ("runs", f"{len(records)}, exit codes {' '.join(str(r.get('exit_code')) for r in records)}" if records else ""),
        *wall_facts(records),
        ("shard seconds (sum)", fmt(summary["seconds"])),
        ("first start to last finish", f"{fmt(summary['span_seconds'])} s" if summary["span_seconds"] else ""),
        ("time per stage (sum)", ", ".join(f"{k} {v:.2f}s" for k, v in stage_totals.items() if v)),
    ]
    try:
        sheet = base64.b64encode(png_bytes(contact_sheet(out, n, cols))).decode()
        sheet_html = f'<img alt="the first {n} samples" src="data:image/png;base64,{sheet}">'
    except ValueError as e:
        sheet_html = f"<p>{escape(str(e))}</p>"
    failed = [s for s in shards if s["status"] in ("failed", "damaged")]
    info = {"shards": {str(s["index"]): s["status"] for s in shards}, "conf": cfg["name"]}
    info["command"] = records[-1].get("command") if records else None
    rerun = rerun_command(str(out), info) if failed else ""
    run_head = ("run", "start", "exit", "images", "wall s", "images/s", "shards", "start-up s", "rejected rows")
    run_head += ("command",)
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
            "<h2>Runs</h2>",
            '<table class="runs"><thead><tr>' + "".join(f"<th>{h}</th>" for h in run_head) + "</tr></thead><tbody>",
            *run_rows(records),
            "</tbody></table>",
            *failed_section(store, failed, rerun),
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


def rejected_fact(record: dict) -> str:
    """dataset.bad_rows=skip: how many rows the last run set aside, and the file that lists them with reasons."""
    return f"{record['rejected']}, with their reasons in {record.get('rejected_file', 'rejected/')}"


def wall_facts(records: list[dict]) -> list[tuple[str, str]]:
    """The terminal summary's figures: images over each run's wall time (start-up included), the last run's
    and all runs' together."""
    if not records:
        return []
    last = records[-1]
    images, seconds = sum(r.get("images") or 0 for r in records), sum(r.get("seconds") or 0 for r in records)
    out = [
        (
            "last run",
            f"{last.get('images')} images in {fmt(last.get('seconds'), 1)} s "
            f"({last.get('images_per_s')} images/s), exit {last.get('exit_code')}",
        ),
    ]
    if len(records) > 1 and seconds:
        out.append(("all runs", f"{images} images in {seconds:.1f} s of wall time ({images / seconds:.3f} images/s)"))
    return out


def mark_damaged(shards: list[dict], counts: dict, ledger: Ledger, files: dict[int, str]) -> None:
    """Shards whose state file is damaged, or whose files differ from their state, as status shows them."""
    why = {i: f"its files differ from its state: {w}" for i, w in files.items()}
    why.update((i, f"its state file is damaged: {w}") for i, w in ledger.damaged.items())
    for s in shards:
        if s["index"] in why:
            s["status"], s["error"] = "damaged", why[s["index"]]
    counts.update({k: sum(s["status"] == k for s in shards) for k in ("done", "failed", "pending", "damaged")})


def failed_section(store, failed: list[dict], rerun: str) -> list[str]:
    if not failed:
        return []
    rows = [
        f'<tr class="failed"><td>{s["index"]}</td><td class="text error">{escape(last_line(store, s))}</td></tr>'
        for s in failed
    ]
    return [
        "<h2>Failed and damaged shards</h2>",
        '<table class="failures"><thead><tr><th>shard</th><th>error (last line)</th></tr></thead><tbody>',
        *rows,
        "</tbody></table>",
        f'<p>Rerun them with:</p><pre class="cmd">{escape(rerun)}</pre>',
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", help="the run folder: a local path, gs://... or s3://...")
    parser.add_argument("--out", type=Path, help="where to write the page (default OUTPUT_DIR/report.html)")
    args = parser.parse_args(argv)
    try:
        page = report_html(args.output_dir)
    except (FileNotFoundError, NotImplementedError, ConfigError) as e:  # ConfigError: credentials in the address
        print(error_line(e), file=sys.stderr)
        return 2
    print(write_output(args.output_dir, "report.html", page.encode(), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
