"""Scheduled runs over a growing prompt source: only new work is done, changed prompts are caught."""

import shutil
from pathlib import Path

from conftest import REPO, bare_flux2, file_snapshot, launch, pixels, read_rows

PROMPTS = (REPO / "conf" / "prompts" / "tiny.txt").read_text().splitlines()  # 20 prompts, shards of 8
TP1 = "mesh.tp=1"  # one worker: a cheaper launch, and the mesh plays no part here


def shard_files(out: Path, index: int) -> dict:
    return {k: v for k, v in file_snapshot(out).items() if f"shard-{index:05d}" in k}


def test_appending_prompts_generates_only_the_new_shards(run_job, tiny_model, tmp_path):
    prompts, out = tmp_path / "p.txt", tmp_path / "out"
    args = [f"model.path={tiny_model}", f"dataset.path={prompts}", f"output.dir={out}", TP1]
    prompts.write_text("\n".join(PROMPTS[:13]) + "\n")  # shard 0 full, shard 1 holds 5 of 8
    assert launch(*args).returncode == 0
    shard0 = shard_files(out, 0)
    prompts.write_text("\n".join(PROMPTS) + "\n")  # appended: shard 1 grows, shard 2 is new
    res = launch(*args)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "generating 2 shards" in res.stderr
    assert shard_files(out, 0) == shard0  # same bytes, same modification times
    assert read_rows(out) == read_rows(run_job(TP1))  # equal to one clean run over all the prompts
    assert len(list((out / "runs").glob("*.json"))) == 2  # one record per run


def test_an_edited_prompt_in_a_done_shard_is_caught(run_job, tiny_model, tmp_path):
    prompts, out = tmp_path / "p.txt", tmp_path / "out"
    shutil.copytree(run_job(TP1), out)
    edited = [*PROMPTS]
    edited[10] = "a completely different prompt"
    prompts.write_text("\n".join(edited) + "\n")
    args = [f"model.path={tiny_model}", f"dataset.path={prompts}", f"output.dir={out}", TP1]
    res = launch(*args)
    assert res.returncode == 2
    last = res.stderr.strip().splitlines()[-1]
    assert "shards [1]" in last and "(samples 10)" in last and "run.stale=regenerate" in last
    assert "shifted" not in last and "Traceback" not in res.stderr
    before = file_snapshot(out)
    res = launch(*args, "run.stale=regenerate")
    assert res.returncode == 0, res.stderr[-2000:]
    # What a clean run of the edited prompts holds: every old row but 10, and row 10 with its new prompt and the
    # image that diffusers gives its batch (rows 10 and 11: conf tiny's batches of 2), bit for bit.
    got, old = read_rows(out), read_rows(run_job(TP1))
    assert {k: r for k, r in got.items() if k != "10"} == {k: r for k, r in old.items() if k != "10"}
    assert got["10"]["prompt"] == edited[10] and got["10"]["image"]["path"] == old["10"]["image"]["path"]
    assert {k: v for k, v in got["10"].items() if k not in ("prompt", "image")} == {
        k: v for k, v in old["10"].items() if k not in ("prompt", "image")
    }
    batch = bare_flux2(tiny_model, [old["10"]["seed"], old["11"]["seed"]], prompt=[edited[10], PROMPTS[11]])
    assert [pixels(got[i]["image"]["bytes"]).tolist() for i in ("10", "11")] == [b.tolist() for b in batch]
    after = file_snapshot(out)
    assert {k: v for k, v in after.items() if "00001" not in k and k != "run.json"} == {
        k: v for k, v in before.items() if "00001" not in k and k != "run.json"
    }
    # run.stale=keep is recorded for the shards it kept: the same command without it then exits 0, every night.
    edited[3] = "another edit"
    prompts.write_text("\n".join(edited) + "\n")
    assert launch(*args).returncode == 2
    res = launch(*args, "run.stale=keep")
    assert res.returncode == 0 and "keeping shards [0]" in res.stderr, res.stderr[-2000:]
    assert read_rows(out)["3"]["prompt"] == PROMPTS[3]  # the old image and its prompt stay
    res = launch(*args)
    assert res.returncode == 0 and "nothing to do" in res.stderr, res.stderr[-2000:]
    edited[4] = "a third edit"  # changed again after the keep: stale again
    prompts.write_text("\n".join(edited) + "\n")
    assert launch("--dry-run", *args).returncode == 2
    # A deleted line shifts every later row number (the default ids): the refusal says so and what to do.
    prompts.write_text("\n".join(PROMPTS[:2] + PROMPTS[3:]) + "\n")
    res = launch("--dry-run", *args)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "shards [0, 1, 2]" in last, res.stderr[-2000:]  # shard 2 lost a row
    assert "(samples 2, 3, 4, 5, 6 and more)" in last and "shifted" in last and "dataset.id_column" in last
