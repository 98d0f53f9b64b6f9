"""Build the tiny random-weight FLUX.2 pipeline: `python tools/make_tiny_model.py DIR` (offline, deterministic)."""

import argparse
import logging

from launcher.models.flux2 import build_tiny as build_tiny_flux2

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dir", help="folder to create (must not exist yet)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build_tiny_flux2(parser.parse_args().dir)
