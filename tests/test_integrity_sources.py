"""Each source file read once, an output folder never inside the source's reach, secrets never printed.

In this process (the launcher's main() with --dry-run, or the functions the preflight calls): no worker starts.
"""

import os
import re

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from launcher.sources import globs
from launcher.sources.prompts import source_files

PROMPTS3 = "a red fox\na blue bird\na green frog\n"


def plan_prompts(err_out: str) -> int:
    """The number of prompts a dry run's plan line says it would generate."""
    return int(re.search(r"# plan: .*\((\d+) prompts", err_out).group(1))


def last_error(capsys) -> tuple[str, str]:
    got = capsys.readouterr()
    lines = got.err.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), got.err[-2000:]
    return lines[-1], got.out + got.err


# -- one read per file


def test_a_hard_link_and_a_linked_folder_in_a_glob_are_read_once(tiny_model, tmp_path, launcher_main, capsys):
    (tmp_path / "g" / "a").mkdir(parents=True)
    (tmp_path / "g" / "a" / "p.txt").write_text(PROMPTS3)
    os.link(tmp_path / "g" / "a" / "p.txt", tmp_path / "g" / "a" / "q.txt")  # one file, two names
    (tmp_path / "g" / "b").symlink_to(tmp_path / "g" / "a")  # one folder, two names (as a bind mount would be)
    assert source_files(str(tmp_path / "g" / "**" / "*.txt")) == [str(tmp_path / "g" / "a" / "p.txt")]
    args = ["--dry-run", f"model.path={tiny_model}", f"output.dir={tmp_path / 'out'}"]
    assert launcher_main([*args, f"dataset.path={tmp_path}/g/**/*.txt"]) == 0
    assert plan_prompts(capsys.readouterr().out) == 3  # 3 prompts, not 6 or 12


def test_objects_with_one_size_time_and_etag_are_read_once(s3, monkeypatch):
    """An object store has no inodes: objects that share a size and a time are compared by ETag, one HEAD each;
    an object whose size is its own costs no request."""
    import boto3

    client = boto3.client("s3")
    for key, body in (("d/a.txt", PROMPTS3), ("d/b.txt", PROMPTS3), ("d/c.txt", PROMPTS3.upper()), ("d/e.txt", "x\n")):
        client.put_object(Bucket="meshgen-test", Key=key, Body=body.encode())
    paths = [f"meshgen-test/d/{n}" for n in ("a.txt", "b.txt", "c.txt", "e.txt")]
    same_time = 1_700_000_000_000_000_000  # as a listing would say of objects written in one second
    infos = {
        p: pafs.FileInfo(p, pafs.FileType.File, size=len(PROMPTS3) if "e.txt" not in p else 2, mtime_ns=same_time)
        for p in paths
    }
    heads = []
    real_etag = globs._etag
    monkeypatch.setattr(globs, "_etag", lambda scheme, p: heads.append(p) or real_etag(scheme, p))
    kept = globs.once_each(paths, infos, None, "s3://")
    assert kept == [paths[0], paths[2], paths[3]]  # b.txt is a.txt's content again; c.txt differs in content
    assert sorted(heads) == sorted(paths[:3])  # e.txt: a size of its own, no request


# -- an output folder inside the source's reach


def _parquet(path, n: int = 3) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"prompt": [f"prompt {i}" for i in range(n)]}), path)


@pytest.mark.parametrize(
    "source, out",
    [
        ("{g}/**/*.parquet", "{g}/out"),  # the output's data/*.parquet would match
        ("{g}/*/*.parquet", "{g}/out"),  # not recursive: still lists the folder out/
        ("{g}/**", "{g}/deep/out"),
        ("{g}", "{g}/out"),  # a folder read whole (save_to_disk, an earlier run's folder)
        ("{g}/*/*.parquet", "{link}/out"),  # the same folder under another name
    ],
)
def test_an_output_inside_the_sources_reach_is_refused_at_the_first_run(
    source, out, tiny_model, tmp_path, launcher_main, capsys
):
    g = tmp_path / "g"
    _parquet(g / "src" / "p.parquet")
    (tmp_path / "link").symlink_to(g)
    source, out = source.format(g=g, link=tmp_path / "link"), out.format(g=g, link=tmp_path / "link")
    args = [f"model.path={tiny_model}", f"dataset.path={source}", f"output.dir={out}"]
    for dry in (["--dry-run"], []):
        assert launcher_main([*dry, *args]) == 2
        line, _ = last_error(capsys)
        assert line == (
            f"error: output.dir {out} is inside dataset.path {source}'s reach: its files would be read back as "
            "prompts; choose an output.dir outside it"
        )
        assert not os.path.lexists(out), out  # nothing written


def test_an_output_beside_the_source_is_accepted(tiny_model, tmp_path, launcher_main, capsys):
    g = tmp_path / "g"
    _parquet(g / "p.parquet")
    args = ["--dry-run", f"model.path={tiny_model}", f"output.dir={g / 'out'}"]
    assert launcher_main([*args, f"dataset.path={g}/*.parquet"]) == 0  # lists g only, never g/out
    assert plan_prompts(capsys.readouterr().out) == 3


# -- secrets


def test_a_secret_in_an_address_is_never_printed(tiny_model, launcher_main, capsys):
    address = "s3://b/x?access_key=AKEXAMPLE&secret_key=SECRETEXAMPLE"
    assert launcher_main(["--dry-run", f"model.path={tiny_model}", f"output.dir='{address}'"]) == 2
    line, everything = last_error(capsys)
    assert "output.dir=s3://b/x?access_key=***&secret_key=*** carries credentials" in line, line
    assert "AKEXAMPLE" not in everything and "SECRETEXAMPLE" not in everything
    presigned = "https://h/o.parquet?X-Amz-Credential=AKEXAMPLE&X-Amz-Signature=SIGEXAMPLE&X-Amz-Security-Token=TOK1"
    assert launcher_main(["--dry-run", f"model.path={tiny_model}", f"dataset.path='{presigned}'"]) == 2
    line, everything = last_error(capsys)
    assert "X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Security-Token=*** carries credentials" in line, line
    assert not any(s in everything for s in ("AKEXAMPLE", "SIGEXAMPLE", "TOK1"))
    assert launcher_main(["--cfg", "job", f"output.dir='{address}'"]) == 0  # prints the config: masked
    shown = capsys.readouterr().out
    assert "secret_key=***" in shown and "SECRETEXAMPLE" not in shown


def test_an_endpoint_with_a_user_in_the_environment_is_refused_masked(
    s3, tiny_model, monkeypatch, launcher_main, capsys
):
    endpoint = s3["AWS_ENDPOINT_URL"].replace("http://", "http://USERNAME:pw@")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    args = ["--dry-run", f"model.path={tiny_model}", "output.dir=s3://meshgen-test/out"]
    assert launcher_main(args) == 2
    line, everything = last_error(capsys)
    masked_endpoint = s3["AWS_ENDPOINT_URL"].replace("http://", "http://***@")
    assert f"AWS_ENDPOINT_URL={masked_endpoint} carries credentials" in line, line
    assert "USERNAME" not in everything and ":pw@" not in everything
    from launcher.errors import ConfigError, error_line

    # A library's message that quotes only the user name (pyarrow: "Could not resolve host: USERNAME") is masked.
    assert error_line(ConfigError("Could not resolve host: USERNAME")) == "error: Could not resolve host: ***"
