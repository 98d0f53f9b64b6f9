"""What fingerprinting a FLUX.2-dev-sized pipeline's weights costs: `python -m tools.bench.weights [--gb 64]
[--dir /tmp]`.

Lays out a diffusers pipeline folder (model_index.json; a transformer in 7 shards, a text encoder in 5, a VAE:
the split of the real one's weight bytes) whose weight files are sparse (`truncate`: no disk is used, and reading
returns zeros at memory speed, so what is timed is sha256 itself, a floor for real files read from a disk). Then
times `launcher.weights.model_weights` on it in a fresh process twice: with an empty hash cache (every byte read
and hashed), and again (the rerun of a launch: the cache answers). With --gb below 64 the first time is also
extrapolated linearly to 64 GB (hashing is linear in bytes; the rerun costs a stat per file, whatever its size).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FLUX2_DEV_GB = 64.0
# component -> (shards, share of the weight bytes)
LAYOUT = {"transformer": (7, 0.57), "text_encoder": (5, 0.42), "vae": (1, 0.01)}
CLASSES = {
    "transformer": ["diffusers", "Flux2Transformer2DModel"],
    "text_encoder": ["transformers", "Mistral3ForConditionalGeneration"],
    "vae": ["diffusers", "AutoencoderKLFlux2"],
}
TIMED = """
import json, resource, sys, time
t = time.perf_counter()
from launcher.weights import model_weights
found = model_weights(sys.argv[1])
r = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"s": time.perf_counter() - t, "cpu_s": r.ru_utime + r.ru_stime, "components": len(found.components)}))
"""


def lay_out(root: Path, gb: float) -> int:
    """The sparse pipeline folder; its weight bytes."""
    total = int(gb * 1e9)
    root.mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "Flux2Pipeline", **CLASSES}))
    for name, (shards, share) in LAYOUT.items():
        folder = root / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        stem = "model" if name == "text_encoder" else "diffusion_pytorch_model"
        for i in range(shards):
            suffix = f"-{i + 1:05d}-of-{shards:05d}" if shards > 1 else ""
            with open(folder / f"{stem}{suffix}.safetensors", "wb") as f:
                f.truncate(int(total * share / shards))
    return sum(f.stat().st_size for f in root.rglob("*.safetensors"))


def timed(root: Path, cache: Path) -> dict:
    env = {**os.environ, "MESHGEN_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", TIMED, str(root)], capture_output=True, text=True, env=env, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=FLUX2_DEV_GB, help="weight bytes to lay out, in GB (default 64)")
    ap.add_argument("--dir", default=None, help="where the sparse folder goes (default: the temporary folder)")
    ap.add_argument("--out", default="bench-weights.json")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="meshgen-weights-", dir=args.dir))
    try:
        size = lay_out(work / "pipeline", args.gb)
        first = timed(work / "pipeline", work / "cache")
        again = timed(work / "pipeline", work / "cache")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    scale = FLUX2_DEV_GB * 1e9 / size
    result = {
        "gb": size / 1e9,
        "files": sum(n for n, _ in LAYOUT.values()),
        "first": first,
        "rerun": again,
        "first_gb_per_s": size / 1e9 / first["s"],
        "first_at_64gb_s": first["s"] * scale,
        "load_average": os.getloadavg(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"weights: {size / 1e9:.1f} GB in {result['files']} files (sparse), load average {os.getloadavg()[0]:.1f}")
    rate = result["first_gb_per_s"]
    print(f"  first (empty hash cache): {first['s']:.1f} s ({rate:.2f} GB/s, CPU {first['cpu_s']:.1f} s)")
    if scale != 1:
        print(f"  first, extrapolated to {FLUX2_DEV_GB:.0f} GB: {result['first_at_64gb_s']:.0f} s")
    print(f"  rerun (cached): {again['s']:.2f} s (CPU {again['cpu_s']:.2f} s, the interpreter's start included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
