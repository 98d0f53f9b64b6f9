"""Publishing a run folder's dataset: `python -m tools.publish OUTPUT_DIR TARGET`, and `output.publish` during a run.

Only the dataset goes: each done shard's data files (data/, webdataset/), its image files when asked or when the
Parquet rows point at them (output.embed_images=false), and the card, last. Never state/, logs/, runs/, plans/,
claims/, locks/ or run.json: what a shard's state vouches for (its `files`, with their sizes and sha256) is the
list, so a file the run did not write, or one of a damaged shard, is never sent. A target already holding a file
with the same size and sha256 is not sent it again; a regenerated shard's files replace theirs, and a file the
shard no longer has goes from the target in the same commit. The targets (launcher/publish/targets.py) make
each batch of shards appear at once (one Hub commit) or file by file with the data file after its images.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from launcher.errors import ConfigError
from launcher.ledger.states import DATA_DIR, IMAGES_DIR, READERS, WDS_DIR, read_state, read_states
from launcher.ledger.store import Store

logger = logging.getLogger(__name__)

COMMIT_FILES = 1000  # files per commit at most (whole shards: a bigger shard goes alone)
COMMIT_BYTES = 4 * 2**30  # bytes per commit at most, likewise


@dataclass
class ShardFiles:
    index: int
    files: dict[str, tuple[int, str]]  # name in the folder (and at the target) -> (size, sha256)

    @property
    def prefixes(self) -> tuple[str, ...]:
        """Where this shard's files live: a target file there that the shard no longer has is removed."""
        name = f"shard-{self.index:05d}"
        return (f"{DATA_DIR}/{name}.", f"{WDS_DIR}/{name}.", f"{IMAGES_DIR}/{name}/")


@dataclass
class Batch:
    """What one commit carries: files to send and target files to remove."""

    shards: list[int] = field(default_factory=list)
    files: dict[int, dict[str, tuple[int, str]]] = field(default_factory=dict)  # each shard's whole file list
    send: dict[str, tuple[int, str]] = field(default_factory=dict)
    remove: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(size for size, _ in self.send.values())


def dataset_shards(run: Store, images: bool | None = None, only: Iterable[int] | None = None) -> list[ShardFiles]:
    """The done shards' dataset files with their recorded sizes and sha256, damaged shards left out (with a warning)."""
    from launcher.ledger.verify import listed_damage, say_damage

    if not run.exists("run.json"):
        raise ConfigError(f"{run} has no run.json: is it a meshgen output folder? (give the run's output.dir)")
    wanted = None if only is None else set(only)
    states = {
        i: s for i, s in read_states(run).items() if s.get("status") == "done" and (wanted is None or i in wanted)
    }
    damage = listed_damage(run, states)
    say_damage(run, damage)
    done = sorted(set(states) - set(damage))
    with ThreadPoolExecutor(max(1, min(READERS, len(done)))) as pool:  # the index keeps sizes, not hashes
        full = list(pool.map(lambda i: read_state(run, i), done))
    shards = []
    for i, st in zip(done, full, strict=True):
        if st is None or st.get("status") != "done":
            continue  # changed since the listing: the next push judges it
        files = {n: (e[0], e[1]) for n, e in (st.get("files") or _old_files(run, i)).items()}
        data = {n: e for n, e in files.items() if not n.startswith(f"{IMAGES_DIR}/")}
        # Image files go wherever a shard has them (decided per shard: a folder's settings may change between
        # runs, and rows made with output.embed_images=false point at them), unless --no-images; a shard with no
        # data file (output.parquet=false, no webdataset) always sends them: they are the dataset.
        keep = files if images is not False or not data else data
        shards.append(ShardFiles(i, keep))
    return shards


def _old_files(run: Store, index: int) -> dict[str, list]:
    """A state written before states recorded their files: its Parquet file, hashed here."""
    import hashlib

    from launcher.ledger.verify import parquet_rel

    data = run.read_bytes(parquet_rel(index))
    return {} if data is None else {parquet_rel(index): [len(data), hashlib.sha256(data).hexdigest()]}


def plan_batches(shards: list[ShardFiles], target) -> list[Batch]:
    """The shards whose files the target lacks or holds otherwise, in batches of whole shards."""
    have = target.listing()
    batches, batch = [], Batch()
    for shard in shards:
        send = {n: e for n, e in shard.files.items() if not target.same(n, e, have.get(n))}
        remove = [n for n in have if n.startswith(shard.prefixes) and n not in shard.files]
        if not send and not remove:
            continue
        nbytes = sum(size for size, _ in send.values())
        full = len(batch.send) + len(send) > COMMIT_FILES or batch.nbytes + nbytes > COMMIT_BYTES
        if batch.shards and full:
            batches.append(batch)
            batch = Batch()
        batch.shards.append(shard.index)
        batch.files[shard.index] = shard.files
        batch.send.update(send)
        batch.remove += remove
    return batches + ([batch] if batch.shards else [])


def publish(
    out: str | Store,
    target_uri: str,
    images: bool | None = None,
    only: Iterable[int] | None = None,
    card: bool = True,
    say: Callable[[str], None] = logger.info,
    target=None,
) -> dict:
    """Push the dataset of run folder `out` to `target_uri`; what was sent: {"shards", "files", "bytes", "card"}."""
    from launcher.publish.targets import open_target

    run = out if isinstance(out, Store) else Store(out)
    if not run.exists("run.json"):
        raise ConfigError(f"{run} has no run.json: is it a meshgen output folder? (give the run's output.dir)")
    target = target or open_target(target_uri, run)  # probes it: a refusal is one line before anything is sent
    if card:  # the card's source too: a run.json that meshgen did not write is one line before anything is sent
        from launcher.publish.card import run_meta

        run_meta(run)
    shards = dataset_shards(run, images, only)
    batches = plan_batches(shards, target)
    sent = {"shards": 0, "files": 0, "bytes": 0, "card": False}
    for n, batch in enumerate(batches, 1):
        target.push(run, batch, f"meshgen: shards {_span(batch.shards)}")
        sent["shards"] += len(batch.shards)
        sent["files"] += len(batch.send)
        sent["bytes"] += batch.nbytes
        say(f"{target.uri}: commit {n}/{len(batches)}: shards {_span(batch.shards)} ({len(batch.send)} files)")
    if card:
        sent["card"] = target.put_card(run, [s.index for s in shards])
    return sent


def _span(ids: list[int]) -> str:
    return str(ids[0]) if len(ids) == 1 else f"{ids[0]}..{ids[-1]} ({len(ids)})"


def main(argv: list[str] | None = None) -> int:
    """`python -m tools.publish OUTPUT_DIR TARGET`: 0 all pushed; 2 a refusal before anything was sent (one line);
    3 the push stopped part way (what reached the target is whole; the same command finishes it)."""
    import argparse
    import sys

    from launcher.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_SHARDS_FAILED, error_line

    parser = argparse.ArgumentParser(prog="python -m tools.publish", description=main.__doc__)
    parser.add_argument("output_dir", help="the run's output.dir: a local folder, s3:// or gs://")
    parser.add_argument("target", help="hf://datasets/ORG/NAME[@REVISION], s3://BUCKET/PATH or gs://BUCKET/PATH")
    images = parser.add_mutually_exclusive_group()
    images.add_argument("--images", dest="images", action="store_true", default=None, help="image files (default)")
    images.add_argument("--no-images", dest="images", action="store_false", help="not the image files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # the libraries' warnings; our lines: print
    try:
        sent = publish(args.output_dir, args.target, images=args.images, say=print)
    except ConfigError as e:
        print(error_line(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:  # noqa: BLE001 - a network or server failure mid-push: one line, the rerun finishes it
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        print(
            error_line(
                ValueError(
                    f"the push to {args.target} stopped ({why}); what reached it is whole: run the "
                    "same command to finish it"
                )
            ),
            file=sys.stderr,
        )
        return EXIT_SHARDS_FAILED
    card = "and the card" if sent["card"] else "(the card was up to date)"
    print(f"{args.target}: sent {sent['files']} files of {sent['shards']} shards ({sent['bytes']} bytes) {card}")
    return EXIT_OK
