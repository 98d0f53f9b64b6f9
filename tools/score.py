"""Add the quality columns to a finished run folder without regenerating: `python -m tools.score OUTPUT_DIR`.

Each done shard's Parquet is read a row group at a time, its images scored (`clip_score` and `nsfw`, as
launcher/worker/quality.py computes them during a run: from the stored images, so a lossy format scores its
decoded pixels), and the file rewritten whole or not at all with the columns added (replaced where there); then
its state records the new file's size and sha256, so that "done means verified" still holds. A crash between
the two leaves a shard that the next run finds damaged and regenerates: nothing reads a half-scored file.
A shard that already has the asked columns is skipped (--force scores it again), and so is a damaged one (a file
missing, or not the size and sha256 its state records): scoring it would record its damage as the truth; the
next run regenerates it. A live run on the folder is refused: it writes the same files. The WebDataset tars keep
their JSON as it was: the columns go to the Parquet only.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys

import numpy as np

from launcher.errors import ConfigError, error_line
from launcher.ledger.states import read_state, read_states, state_rel
from launcher.ledger.store import Store
from launcher.ledger.verify import listed_damage, parquet_rel, say_damage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir")
    parser.add_argument("--columns", default="clip_score,nsfw", help="which: clip_score, nsfw, or both (default)")
    parser.add_argument("--clip-model", default=None, help="default: the run's quality.clip_model")
    parser.add_argument("--safety-model", default=None, help="default: the run's quality.safety_model")
    parser.add_argument("--device", default="auto", help="auto (cuda if there is one, else cpu), cuda, cpu")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--force", action="store_true", help="score shards that have the columns already")
    args = parser.parse_args(argv)
    import pyarrow as pa

    try:
        done = score_folder(Store(args.output_dir), args)
    except ConfigError as e:
        print(error_line(e), file=sys.stderr)
        return 2
    except (OSError, pa.ArrowException) as e:  # a store that fails, a file that changed under us
        print(error_line(f"{args.output_dir}: {type(e).__name__}: {e}; run the same command again"), file=sys.stderr)
        return 2
    print(f"scored {done} shards")
    return 0


def quality_config(run: dict, args):
    from omegaconf import OmegaConf

    from launcher.config import QualityConfig

    wanted = {c.strip() for c in args.columns.split(",") if c.strip()}
    if not wanted or wanted - {"clip_score", "nsfw"}:
        raise ConfigError(f"--columns={args.columns}: name clip_score, nsfw or both (clip_score,nsfw)")
    q = OmegaConf.merge(OmegaConf.structured(QualityConfig), (run.get("config") or {}).get("quality") or {})
    q.clip_score, q.safety, q.batch_size = "clip_score" in wanted, "nsfw" in wanted, args.batch_size
    q.clip_model = args.clip_model or q.clip_model
    q.safety_model = args.safety_model or q.safety_model
    return q


def score_folder(store: Store, args) -> int:
    import torch

    from launcher.ledger.lock import live_run_ids
    from launcher.worker.quality import Scorer

    run = store.read_json("run.json")
    if not isinstance(run, dict):
        raise ConfigError(f"{store} has no readable run.json; is it a meshgen output folder?")
    if live_run_ids(store):
        raise ConfigError(f"{store} is being written by a live run; score it once that run has ended")
    q = quality_config(run, args)
    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    dtype = (run.get("config") or {}).get("model", {}).get("dtype", "bfloat16") if device != "cpu" else "float32"
    states = {i: st for i, st in read_states(store).items() if st.get("status") == "done"}
    if any("files" in st and parquet_rel(i) not in st["files"] for i, st in states.items()):
        raise ConfigError(f"{store} has no Parquet files (output.parquet=false): nothing to add columns to")
    damage = listed_damage(store, states)
    say_damage(store, damage)
    scorer, n = None, 0
    for i in sorted(set(states) - set(damage)):
        state = read_state(store, i)
        pf = _verified_parquet(store, i, state)
        if pf is None:
            continue
        if not args.force and set(Scorer.names_for(q)) <= set(pf.schema_arrow.names):
            continue
        scorer = scorer or Scorer(q, device, dtype)
        rewrite(store, i, pf, scorer, state)
        n += 1
    return n


def _verified_parquet(store: Store, index: int, state: dict | None):
    """The shard's Parquet, read once, if it is still what its done state records; None (said) otherwise."""
    import pyarrow.parquet as pq

    rel = parquet_rel(index)
    data = store.read_bytes(rel)
    recorded = ((state or {}).get("files") or {}).get(rel)
    if state is None or state.get("status") != "done" or data is None:
        return None  # changed since the listing: nothing to score
    if recorded is not None and list(recorded) != [len(data), hashlib.sha256(data).hexdigest()]:
        print(f"shard {index}: {store.url(rel)} is not what its state records: left for the next run", file=sys.stderr)
        return None
    return pq.ParquetFile(io.BytesIO(data))


def rewrite(store: Store, index: int, pf, scorer, state: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from launcher.writer.writer import QUALITY_COLUMNS

    group = pf.metadata.row_group(0).num_rows if pf.metadata.num_row_groups else 64
    buf, writer, schema = io.BytesIO(), None, None
    for batch in pf.iter_batches(batch_size=group):
        images = [_pixels(store, v) for v in batch.column("image").to_pylist()]
        cols = scorer.columns(images, batch.column("prompt").to_pylist())
        table = pa.Table.from_batches([batch])
        for name, values in cols.items():
            if name in table.schema.names:
                table = table.drop_columns([name])
            kind = QUALITY_COLUMNS[name][0]
            table = table.append_column(pa.field(name, kind), pa.array(values, kind))
        if writer is None:
            schema = _with_features(table.schema, pf.schema_arrow, cols)
            writer = pq.ParquetWriter(buf, schema, compression="zstd")
        writer.write_table(table.cast(schema), row_group_size=group)
    if writer is None:
        return
    writer.close()
    data = buf.getvalue()
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    rel = parquet_rel(index)
    store.write_bytes(rel, data)
    state.setdefault("files", {})[rel] = [len(data), hashlib.sha256(data).hexdigest()]
    state["data_bytes"] = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
    store.write_json(state_rel(index), state)


def _with_features(schema, old, cols):
    from launcher.writer.writer import QUALITY_COLUMNS

    meta = json.loads((old.metadata or {}).get(b"huggingface", b'{"info": {"features": {}}}'))
    features = meta["info"]["features"]
    features.update({k: QUALITY_COLUMNS[k][1] for k in cols})
    return schema.with_metadata({"huggingface": json.dumps({"info": {"features": features}})})


def _pixels(store: Store, image: dict) -> np.ndarray:
    from PIL import Image

    data = image["bytes"]
    if data is None:  # output.embed_images=false: the row points at its file, from the folder's root
        data = store.read_bytes(image["path"])
        if data is None:
            raise ConfigError(f"{store.url(image['path'])} is missing; run the same job again to regenerate it")
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


if __name__ == "__main__":
    sys.exit(main())
