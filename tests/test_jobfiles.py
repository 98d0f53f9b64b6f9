"""Job files anywhere (conf=PATH.yaml), paths against the working directory, --help and --cfg job (issue 21)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import launch


def flat_keys(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        if isinstance(v, dict) and v and k not in ("call_kwargs", "cache_options"):
            out |= flat_keys(v, f"{prefix}{k}.")
        else:
            out.add(f"{prefix}{k}")
    return out


def test_help_lists_the_confs_the_groups_and_every_composed_key(launcher_main, capsys):
    main = launcher_main
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: ./launch.sh [--dry-run] [--help] [--cfg job]")
    confs = text.split("confs:\n")[1].split("\n\n")[0]
    assert {ln.split()[0] for ln in confs.splitlines()} >= {"tiny", "flux2_tp", "qwenimage_tp", "sd35_medium"}
    # A group's options wrap onto indented lines: join them to the group's own line.
    groups = text.split("groups (group=option):\n")[1].split("\n\n")[0].replace(",\n" + " " * 23, ", ")
    assert any(ln.split()[0] == "mesh" and "v6e8_tp8" in ln for ln in groups.splitlines())
    assert any(ln.split()[0] == "model" and "flux2_dev," in ln for ln in groups.splitlines())
    keys = text.split("keys (type, default; what it means):\n")[1]
    listed = {ln.split()[0]: ln for ln in keys.splitlines() if ln.startswith("  ") and not ln.startswith("   ")}
    # Every key of a composed job is listed (the config as Hydra composes it, not the list's own source).
    assert main(["--cfg", "job"]) == 0
    composed = flat_keys(yaml.safe_load(capsys.readouterr().out))
    assert composed <= set(listed), composed - set(listed)
    assert listed["generate.height"].split()[1:] == ["int", "1024"]
    assert listed["mesh.tp"].split()[1:] == ["int", "|", "auto", "1"]
    assert listed["dataset.id_column"].split()[1:] == ["str", "|", "null", "None"]


def test_cfg_job_prints_the_composed_config_with_its_overrides(launcher_main, capsys):
    main = launcher_main
    assert main(["--cfg", "job", "generate.seed=9", "model=tiny_sd3"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["generate"]["seed"] == 9 and cfg["model"]["path"].endswith("models/tiny-sd3") and cfg["name"] == "tiny"
    assert main(["--cfg", "all"]) == 2
    assert capsys.readouterr().err.strip() == "error: --cfg all: only --cfg job is known here"


@pytest.fixture
def job_dir(tmp_path):
    """A team's own repo: a job file naming the project's groups and a file beside it."""
    jobs = tmp_path / "team" / "jobs"
    jobs.mkdir(parents=True)
    (jobs / "nightly.yaml").write_text(
        "defaults:\n  - schema\n  - model: tiny_flux2\n  - mesh: cpu_tp2\n  - sizes\n  - _self_\n"
        "device: cpu\ndataset:\n  path: prompts.txt\noutput:\n  dir: out\n"
        "generate:\n  num_inference_steps: 2\n  max_sequence_length: 256\nrun:\n  shard_size: 4\n"
    )
    (jobs / "sizes.yaml").write_text("generate:\n  height: 32\n  width: 48\n")
    work = tmp_path / "work"
    work.mkdir()
    (work / "prompts.txt").write_text("".join(f"a red square number {i}\n" for i in range(6)))
    return tmp_path


def test_a_job_file_kept_elsewhere_runs_from_another_folder(job_dir, tiny_model):
    work = job_dir / "work"
    res = launch("--cfg", "job", "conf=../team/jobs/nightly.yaml", cwd=work)
    cfg = yaml.safe_load(res.stdout)
    assert (cfg["name"], cfg["generate"]["width"], cfg["mesh"]["tp"]) == ("nightly", 48, 2)  # file beside, group
    assert cfg["dataset"]["path"] == str(work / "prompts.txt") and cfg["output"]["dir"] == str(work / "out")
    dry = launch("--dry-run", "conf=../team/jobs/nightly.yaml", f"model.path={tiny_model}", cwd=work)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "# plan: 2 of 2 shards to generate (6 prompts, 6 images); 0 done, 0 failed, 0 stale" in dry.stdout
    assert "per rank: transformer <0.1 GiB, text_encoder <0.1 GiB, vae <0.1 GiB)" in dry.stdout  # tiny parts
    assert f"conf={job_dir / 'team' / 'jobs' / 'nightly.yaml'}" in dry.stdout.splitlines()[-1]  # workers: absolute
    res = launch("conf=../team/jobs/nightly.yaml", f"model.path={tiny_model}", cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = pq.read_table(work / "out" / "data").to_pylist()
    assert sorted(r["id"] for r in rows) == [str(i) for i in range(6)]
    assert {(r["height"], r["width"]) for r in rows} == {(32, 48)}
    assert not (job_dir / "team" / "jobs" / "out").exists()
    missing = launch("conf=../team/jobs/weekly.yaml", cwd=work)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines()[-1].startswith(
        "error: conf=../team/jobs/weekly.yaml: no such job file"
    )


def test_small_things_users_trip_on(tmp_path):
    """jpg is jpeg (the files' suffix); status.py exits 2 without run.json, as the other tools; the nightly unit
    counts a systemctl stop (143) as a clean stop."""
    import configparser
    import subprocess
    import sys

    from conftest import REPO

    from launcher.config import load_config

    assert load_config("tiny", ["output.format=jpg"]).output.format == "jpeg"
    res = subprocess.run(
        [sys.executable, "tools/status.py", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert (
        res.returncode == 2
        and res.stderr.strip() == f"error: {tmp_path} has no readable run.json; is it a meshgen output folder?"
    )
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(REPO / "deploy" / "meshgen-nightly.service")
    assert set(unit["Service"]["SuccessExitStatus"].split()) == {"4", "143"}
