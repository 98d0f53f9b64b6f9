"""The control plane at scale: the cost of a run start over a big prompt source and a long ledger.

    python -m tools.bench.control [--sizes 10000,100000,1000000,10000000] [--s3-sizes 10000,100000,1000000]
                                  [--s3-done 2000] [--out control.json]

For each size it writes a JSONL source of that many prompts and a run folder in which every shard (of
--shard-size prompts) is done, as a finished run leaves it (state files with the shards' fingerprints, run.json),
then times `./launch.sh` on it with nothing to do: once cold (the ledger's index does not exist yet) and once
warm (the nightly case), with the peak resident memory of every process of the job (sampled every 20 ms).
At the largest local size it also runs with shard 0 pending, against the same job over a one-shard source: the
launcher's peak, and each worker's peak above that of the small job (the loaded model is the same in both).
On S3 (a local moto server, whose access log counts the requests) the source and the folder are both in the
bucket; --s3-done one-prompt shards against a one-prompt folder gives the issue's "at most 3 s slower" comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def write_source(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for start in range(0, n, 100_000):
            f.write(
                "".join(
                    f'{{"prompt": "prompt number {i}, a small test scene"}}\n'
                    for i in range(start, min(n, start + 100_000))
                )
            )


def fill_ledger(cfg, done_shards: int | None = None) -> int:
    """Mark every shard of the job done (or the first `done_shards`), as finished runs leave them."""
    from launcher.ledger import runs
    from launcher.ledger.states import state_rel
    from launcher.ledger.store import Store
    from launcher.plan.plan import make_plan

    store, plan = Store(cfg.output.dir), make_plan(cfg, {})
    runs.write_run_json(store, cfg, len(plan.shards))
    shards = plan.shards[:done_shards] if done_shards else plan.shards
    now = time.time()

    def one(s):
        state = {"status": "done", "rows": s.rows, "prompts_fingerprint": s.fingerprint, "run_id": "bench"}
        store.write_json(state_rel(s.index), {**state, "seconds": 1.0, "finished_at": now, "stages": {}})

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(one, shards))
    return len(shards)


def timed_launch(args: list[str], env: dict, log: Path | None = None) -> dict:
    """Wall time, exit code and per-process peak RSS (MB) of one ./launch.sh; launcher and workers apart."""
    full_env = {**os.environ, "PYTHON": sys.executable, **env}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [str(REPO / "launch.sh"), *args], env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    root, peaks = psutil.Process(proc.pid), {}
    while proc.poll() is None:
        try:
            top = root.cmdline()
            for p in [root, *root.children(recursive=True)]:
                cmd = p.cmdline()
                if p != root and cmd == top:
                    continue  # forked, not yet exec'd (a subprocess starting): the launcher's pages, counted twice
                rss = p.memory_info().rss
                role = "worker" if "launcher.worker" in " ".join(cmd) else "launcher" if p == root else "other"
                peaks[(role, p.pid)] = max(peaks.get((role, p.pid), 0), rss)
        except psutil.Error:
            pass
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    err = proc.stderr.read()
    by_role: dict[str, float] = {}
    for (role, _), rss in peaks.items():
        by_role[role] = max(by_role.get(role, 0), rss / 2**20)
    return {
        "wall_s": round(wall, 2),
        "exit": proc.returncode,
        "peak_mb": {k: round(v) for k, v in by_role.items()},
        "last_line": err.strip().splitlines()[-1] if err.strip() else "",
    }


def job_args(model: str, src: str, out: str, shard_size: int) -> list[str]:
    return [
        f"model.path={model}",
        f"dataset.path={src}",
        f"output.dir={out}",
        f"run.shard_size={shard_size}",
        "mesh.tp=1",
        "mesh.dp=1",
        "generate.num_inference_steps=1",
    ]


def start_run(model: str, src: str, out: str, shard_size: int, env: dict, done: int | None = None) -> dict:
    """A folder with every shard (or `done` shards) done; a nothing-to-do rerun cold, then warm."""
    from launcher.config import load_config

    os.environ.update(env)
    cfg = load_config("tiny", job_args(model, src, out, shard_size))
    t0 = time.perf_counter()
    shards = fill_ledger(cfg, done)
    fill_s = time.perf_counter() - t0
    cold = timed_launch(job_args(model, src, out, shard_size), env)
    warm = timed_launch(job_args(model, src, out, shard_size), env)
    return {"shards": shards, "fill_s": round(fill_s, 1), "cold": cold, "warm": warm}


class MotoServer:
    """A local S3 server whose access log counts the requests a run makes."""

    def __init__(self, folder: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = folder / "moto.log"
        self.env = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}",
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        moto = Path(sys.executable).parent / "moto_server"
        self.proc = subprocess.Popen(
            [str(moto), "-H", "127.0.0.1", "-p", str(self.port)], stdout=open(self.log, "w"), stderr=subprocess.STDOUT
        )
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        import boto3

        boto3.client(
            "s3",
            endpoint_url=self.env["AWS_ENDPOINT_URL"],
            region_name="us-east-1",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
        ).create_bucket(Bucket="bench")

    def requests(self) -> int:
        return len(re.findall(r'"(GET|PUT|HEAD|POST|DELETE) ', self.log.read_text()))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def bench_control(model: str, sizes: list[int], s3_sizes: list[int], s3_done: int, shard_size: int, work: Path) -> dict:
    result: dict = {"shard_size": shard_size, "local": {}, "s3": {}}
    for n in sizes:
        src, out = work / f"p{n}.jsonl", work / f"out{n}"
        write_source(src, n)
        result["local"][n] = start_run(model, str(src), str(out), shard_size, {})
        print(f"local {n}: {result['local'][n]}", file=sys.stderr)
    if sizes:  # the largest source with shard 0 pending, against a one-shard source
        n = max(sizes)
        src, out = work / f"p{n}.jsonl", work / f"out{n}"
        (out / "state" / "shard-00000.json").unlink()
        big = timed_launch(job_args(model, str(src), str(out), shard_size), {})
        small_src = work / "p1.jsonl"
        write_source(small_src, shard_size)
        small = timed_launch(job_args(model, str(small_src), str(work / "out1"), shard_size), {})
        result["shard0_pending"] = {
            "source": n,
            "big": big,
            "one_shard_source": small,
            "worker_above_small_mb": big["peak_mb"].get("worker", 0) - small["peak_mb"].get("worker", 0),
        }
        print(f"shard 0 pending: {result['shard0_pending']}", file=sys.stderr)
    if s3_sizes or s3_done:
        import pyarrow.fs as pafs

        server = MotoServer(work)
        try:
            os.environ.update(server.env)
            fs = pafs.S3FileSystem(
                endpoint_override=f"127.0.0.1:{server.port}",
                scheme="http",
                access_key="bench",
                secret_key="bench",
                region="us-east-1",
            )
            # The sizes of the table, then the comparison: s3_done one-image shards against one.
            runs = [(n, shard_size) for n in s3_sizes] + ([(s3_done, 1), (1, 1)] if s3_done else [])
            for n, size in runs:
                key = f"bench/p{n}.jsonl"
                local = work / f"p{n}.jsonl"
                if not local.exists():
                    write_source(local, n)
                pafs.copy_files(str(local), key, pafs.LocalFileSystem(), fs)
                before = server.requests()
                run = start_run(model, f"s3://{key}", f"s3://bench/out{n}-{size}", size, server.env)
                run["requests_fill_and_runs"] = server.requests() - before
                mark = server.requests()
                run["warm_again"] = timed_launch(
                    job_args(model, f"s3://{key}", f"s3://bench/out{n}-{size}", size), server.env
                )
                run["requests_one_warm_start"] = server.requests() - mark
                result["s3"][f"{n}/{size}"] = run
                print(f"s3 {n}: {run}", file=sys.stderr)
        finally:
            server.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=_ints, default=[10_000, 100_000, 1_000_000, 10_000_000])
    p.add_argument("--s3-sizes", type=_ints, default=[10_000, 100_000, 1_000_000])
    p.add_argument("--s3-done", type=int, default=2000, help="done shards of the S3 comparison (0: none)")
    p.add_argument("--shard-size", type=int, default=256)
    p.add_argument("--model", default=None, help="tiny pipeline folder (default: built into the work folder)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default="control.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-control-", dir=args.workdir) as tmp:
        model = args.model
        if model is None:
            from launcher.models.flux2 import build_tiny

            model = str(build_tiny(Path(tmp) / "tiny-flux2"))
        result = bench_control(model, args.sizes, args.s3_sizes, args.s3_done, args.shard_size, Path(tmp))
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


def table(r: dict) -> str:
    lines = [
        "| store | prompts | shards | nothing-to-do start, cold / warm / again (s) | peak MB launcher | requests |",
        "|---|---|---|---|---|---|",
    ]
    for store in ("local", "s3"):
        for n, run in r[store].items():
            prompts = int(str(n).split("/")[0])
            starts = " / ".join(str(run[k]["wall_s"]) for k in ("cold", "warm", "warm_again") if k in run)
            peak, requests = run["warm"]["peak_mb"].get("launcher"), run.get("requests_one_warm_start", "")
            lines.append(f"| {store} | {prompts:,} | {run['shards']:,} | {starts} | {peak} | {requests} |")
    if "shard0_pending" in r:
        s = r["shard0_pending"]
        lines.append(
            f"\nshard 0 pending over {s['source']:,} prompts: {s['big']['wall_s']} s, launcher "
            f"{s['big']['peak_mb'].get('launcher')} MB, worker {s['big']['peak_mb'].get('worker')} MB "
            f"({s['worker_above_small_mb']:+} MB against a one-shard source: "
            f"{s['one_shard_source']['peak_mb'].get('worker')} MB)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
