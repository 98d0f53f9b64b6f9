"""Build a tiny random-weight pipeline: `python tools/make_tiny_model.py DIR [--family flux2]` (offline,
deterministic). Families: flux2 (the default job's), flux1, sd3, qwenimage, flux2_klein."""

import argparse
import logging

from launcher.models import build, builders

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dir", help="folder to create (must not exist yet)")
    names = sorted(b.removeprefix("tiny_") for b in builders())
    parser.add_argument("--family", default="flux2", choices=names, help="which family's tiny pipeline")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build(f"tiny_{args.family}", args.dir)
