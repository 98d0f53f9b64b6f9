"""A full disk stops the run cleanly: exit 3, no traceback, a last line that names the folder and the free
space, no temporary files, no shard wrongly done; the same command finishes the job once there is room.

The disk is a real small tmpfs, else an ext2 image on a loop device (mounting needs root, as in CI's container:
there a failure to mount fails the test; as another user it is skipped with a warning that says so).
"""

import os
import subprocess
import warnings

import pytest
from conftest import SLOW_N, launch, read_rows
from test_faults import assert_same_as_clean

N = SLOW_N  # the fault tests' slow job: its clean run is shared with them


def _mount_small_disk(mnt, tmp_path) -> str | None:
    """Mount a 2 MiB filesystem at `mnt`: a tmpfs, else an ext2 image on a loop device. None, or why not."""
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if not res.returncode:
        return None
    image = tmp_path / "disk.img"
    image.write_bytes(b"\0" * 2 * 2**20)
    for cmd in (["mkfs.ext2", "-q", "-F", "-m", "0", str(image)], ["mount", "-o", "loop", str(image), str(mnt)]):
        loop = subprocess.run(cmd, capture_output=True, text=True)
        if loop.returncode:
            return f"tmpfs: {res.stderr.strip()}; loop file: {loop.stderr.strip()}"
    return None


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    why = _mount_small_disk(mnt, tmp_path)
    if why and os.geteuid() == 0:  # CI runs as root: there a disk that cannot be made is a failure, not a skip
        pytest.fail(f"cannot make a small disk as root ({why})")
    if why:
        warnings.warn(f"the full-disk test did not run: mounting needs root ({why})", stacklevel=1)
        pytest.skip(f"NOT TESTED: a full disk (mounting needs root: {why})")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_stops_the_run_cleanly_and_the_same_command_finishes(slow, small_disk):
    job, clean = slow
    # The shards' data, the same bytes on every run (logs and states vary with the host's load and timing).
    need = sum(p.stat().st_size for p in (clean / "data").rglob("*") if p.is_file())
    filler = small_disk / "filler"
    # Room for the bookkeeping and about a third of the shards' files: below the start's estimate of the images.
    room = os.statvfs(small_disk)
    free = room.f_bavail * room.f_frsize - need // 3 - 64 * 1024
    filler.write_bytes(b"\0" * free)
    out = small_disk / "out"
    res = launch(*job, f"output.dir={out}")
    err = res.stderr
    assert res.returncode == 3, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: {out} is out of space (") and " free)" in last, last
    assert "the run will stop when it is full" in err  # the estimate at the start saw it coming
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name], "temporary files left"
    done = read_rows(out)
    assert 0 < len(done) < N
    assert all(done[k]["image"]["bytes"] == v["image"]["bytes"] for k, v in read_rows(clean).items() if k in done)
    filler.unlink()  # room again: the same command finishes the job
    res = launch(*job, f"output.dir={out}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_as_clean(out, clean, N)
