"""The benchmark's printed table: one line per number, with its spread and the issue's target where it has one."""

from __future__ import annotations

TARGETS = {  # (metric, comparison, bound)
    "ratio": ("<=", 1.03),
    "weights_private": ("<=", 0.6),
    "writer_per_process": (">=", 6.0),
    "writer_speedup_2": (">=", 1.8),
}


def _verdict(key: str, value: float) -> str:
    if key not in TARGETS:
        return ""
    op, bound = TARGETS[key]
    ok = value <= bound if op == "<=" else value >= bound
    return f"target {op} {bound:g}: {'met' if ok else 'MISSED'}"


def _spread(stat: dict, scale: float = 1.0, digits: int = 3) -> tuple[str, str]:
    f = f"{{:.{digits}f}}"
    return f.format(stat["median"] * scale), f"{f.format(stat['min'] * scale)}-{f.format(stat['max'] * scale)}"


def runner_lines(r: dict) -> list[tuple[str, str, str, str]]:
    s = r["summary"]
    rows = [
        ("runner s/image (after warm-up)", *_spread(s["runner_s_per_image"], digits=4), ""),
        ("bare loop s/image (after warm-up)", *_spread(s["bare_s_per_image"], digits=4), ""),
        ("ratio runner / bare", *_spread(s["ratio"]), _verdict("ratio", s["ratio"]["median"])),
        ("ratio, from means over shards", *_spread(s["ratio_mean"]), "one-off stalls included"),
        ("ratio, pooled shards of all repeats", f"{s['pooled']['ratio']:.3f}", "",
         f"writes ratio pooled {s['pooled']['writes_ratio']:.3f}"),
        ("runner without writes s/image", *_spread(s["nowrite_s_per_image"], digits=4), ""),
        ("writes ratio (with / without)", *_spread(s["writes_ratio"]), ""),
        ("writer wait share of generation", *_spread(s["writer_wait_share"], 100, 2), "percent"),
        ("between shards s (bookkeeping)", *_spread(s["between_shards_s"], digits=4), "claim, plan read, hand-over"),
        ("  as a share of a shard's generation", *_spread(s["between_shards_share"], 100, 2), "percent"),
        ("background write s/image", *_spread(s["write_seconds_per_image"], digits=4), "off the generation path"),
        ("first shard's write s", *_spread(s["first_write_seconds"], digits=2), "encoding pool start included"),
        ("warm-up s/image: runner / bare", f"{s['runner_warmup_s_per_image']['median']:.4f}",
         f"{s['bare_warmup_s_per_image']['median']:.4f}", "first shard's images"),
        ("time to first image: runner", *_spread(s["runner_first_image_s"], digits=2), "s, to its state file"),
        ("time to first image: bare loop", *_spread(s["bare_first_image_s"], digits=2), "s"),
        ("bare start-up: imports / load / 1st call", f"{s['bare_startup_s']['imports']['median']:.2f}",
         f"{s['bare_startup_s']['load']['median']:.2f} / {s['bare_startup_s']['first_call']['median']:.2f}", "s"),
        ("runner one-image job, wall", *_spread(s["runner_first_wall_s"], digits=2), "s, shut-down included"),
        ("end-to-end s/image: runner", *_spread(s["runner_e2e_s_per_image"], digits=4), "(wall N - wall 1)/(N-1)"),
        ("end-to-end s/image: bare", *_spread(s["bare_e2e_s_per_image"], digits=4), "after its first image"),
        ("same images (runner PNG == bare)", str(s["same_images"]), "", ""),
    ]  # fmt: skip
    return rows


def memory_lines(m: dict) -> list[tuple[str, str, str, str]]:
    rows = []
    for tp in ("tp1", "tp2"):
        worst = max(m["ranks"][tp], key=lambda r: r["private"])
        mb = {k: worst[k] / 2**20 for k in ("private", "weights_private", "weights_private_trimmed", "RssAnon_base")}
        rows.append(
            (
                f"{tp}: private / weights private MiB",
                f"{mb['private']:.0f}",
                f"{mb['weights_private']:.0f}",
                f"baseline {mb['RssAnon_base']:.0f}; after malloc_trim {mb['weights_private_trimmed']:.0f}; "
                f"transformer local {worst['local']['transformer']['bytes'] / 2**20:.0f}",
            )
        )
    q = m["ratio_tp2_over_tp1"]
    verdict = _verdict("weights_private", q["weights_private"])
    rows += [
        ("ratio tp2/tp1: weights private", f"{q['weights_private']:.3f}", "", verdict),
        ("ratio tp2/tp1: after malloc_trim", f"{q['weights_private_trimmed']:.3f}", "", ""),
        ("ratio tp2/tp1: transformer local bytes", f"{q['transformer_local_bytes']:.3f}", "", ""),
        ("ratio tp2/tp1: whole process private", f"{q['private']:.3f}", "", "incl. ~300 MB runtime"),
    ]  # fmt: skip
    return rows


def writer_lines(w: dict) -> list[tuple[str, str, str, str]]:
    rows = []
    for r in w["rows"]:
        rates = r["all_images_per_s"]
        note = f"{r['images_per_s_per_process']:.2f}/s per process, x{r['speedup']:.2f}, {r['mb_per_image']:.2f} MB"
        if (r.get("format", "png"), r["encoder"], r["level"]) == ("png", "imagecodecs", 1) and r["processes"] in (1, 2):
            key = "writer_per_process" if r["processes"] == 1 else "writer_speedup_2"
            note += "; " + _verdict(key, r["images_per_s_per_process"] if r["processes"] == 1 else r["speedup"])
        fmt = r.get("format", "png")
        setting = {"png": f" level {r['level']}", "jpeg": f" quality {r['level']}", "webp": f" quality {r['level']}"}
        name = f"{fmt} {r['encoder']}{setting.get(fmt, '')}, {r['processes']} proc images/s"
        rows.append((name, f"{r['images_per_s']:.2f}", f"{min(rates):.2f}-{max(rates):.2f}", note))
    return rows


def _check(value: float, op: str, bound: float) -> str:
    return f"target {op} {bound:g}: {'met' if (value <= bound if op == '<=' else value >= bound) else 'MISSED'}"


def speed_lines(s: dict) -> list[tuple[str, str, str, str]]:
    rows = []
    for k, bound in (("n1", 1.03), ("n4", 1.0)):
        r = s["n"][k]
        rows.append(
            (
                f"{k}: runner / bare s/image",
                f"{r['runner_s_per_image']:.4f}",
                f"{r['bare_s_per_image']:.4f}",
                f"ratio {r['ratio']:.3f}, {_check(r['ratio'], '<=', bound)}; same images {r['same_images']}",
            )
        )
    o = s["offload"]
    rows += [
        (
            "offload: bytes moved/image bare",
            f"{o['bare']['bytes_per_image']:.0f}",
            "",
            f"{o['prompts']} prompts, enable_model_cpu_offload per call",
        ),
        (
            "offload: bytes moved/image staged",
            f"{o['staged']['bytes_per_image']:.0f}",
            "",
            f"ratio {o['bytes_ratio']:.4f}, {_check(o['bytes_ratio'], '<=', 1 / 50)}",
        ),
        (
            "offload: s/image bare / staged",
            f"{o['bare']['s_per_image']:.4f}",
            f"{o['staged']['s_per_image']:.4f}",
            f"time ratio {o['time_ratio']:.3f}",
        ),
    ]
    r = s["release"]
    rows.append(
        (
            "resident weights denoising: kept / parked",
            f"{r['kept']['weights'] / 2**10:.0f}",
            f"{r['released']['weights'] / 2**10:.0f}",
            f"KiB, ratio {r['ratio']:.3f}",
        )
    )
    for key, c in s["cache"].items():
        note = f"ratio {c['time_ratio']:.3f}; max pixel diff {c['max_pixel_diff']}"
        if key == "steps_20":
            note += "; " + _check(c["time_ratio"], "<=", 0.85)
        rows.append(
            (
                f"taylorseer / none s/image, {key.replace('_', ' ')}",
                f"{c['taylorseer']['s_per_image']:.4f}",
                f"{c['none']['s_per_image']:.4f}",
                note,
            )
        )
    return rows  # fmt: skip


def format_table(result: dict) -> str:
    rows = [("metric", "median", "min-max", "note")]
    env = result["environment"]
    load = f"load {env['loadavg_start'][0]:.2f} -> {env.get('loadavg_end', [0])[0]:.2f}"
    rows.append((f"{env['cpus']} CPUs, torch {env['torch']}", env.get("cuda") or "no GPU", "", load))
    parts = (("runner", runner_lines), ("memory", memory_lines), ("writer", writer_lines), ("speed", speed_lines))
    for part, lines in parts:
        if part in result:
            rows.append((f"-- {part}", "", "", ""))
            rows += lines(result[part])
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip() for r in rows)
