"""output.metrics=PATH: the run's progress as a Prometheus textfile (node-exporter's textfile collector), updated as
shards finish, with the run record's numbers at the end; read back with prometheus_client's own parser."""

import json
import time

import pytest
from conftest import launch, read_rows, slow_job
from prometheus_client.parser import text_string_to_metric_families
from test_faults import start

N = 8  # prompts, in shards of 2: 4 shards


def parse(path) -> dict[str, tuple[str, list]]:
    """name -> (type, samples) of a textfile; the parser raises on anything that is not the text format."""
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(path.read_text())}


def value(families: dict, name: str, **labels) -> float:
    [got] = [s.value for s in families[name][1] if all(s.labels.get(k) == v for k, v in labels.items())]
    return got


def test_a_run_writes_its_progress_as_it_goes_and_the_records_numbers_at_the_end(tiny_model, tmp_path):
    out, prom = tmp_path / "out", tmp_path / "textfile" / "meshgen.prom"
    job = slow_job(tiny_model, tmp_path, N, "mesh.tp=1", "mesh.dp=1", f"output.dir={out}", f"output.metrics={prom}")
    run = start(*job)
    seen = set()  # samples done, in each version of the file read while the run went on
    try:
        while run.poll() is None:
            if prom.exists():  # renamed into place whole: never a half-written file to parse
                seen.add(value(parse(prom), "meshgen_samples_done"))
            time.sleep(0.05)
        _, err = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 0, err[-3000:]
    assert 0 in seen and any(0 < s < N for s in seen), seen  # written at the start and as shards finished

    [record_file] = (out / "runs").glob("*.json")
    record = json.loads(record_file.read_text())
    families = parse(prom)
    labels = {"output": str(out), "run_id": record["run_id"]}
    for name, (kind, samples) in families.items():
        assert all(s.labels.items() >= labels.items() for s in samples), (name, samples)
        assert kind == ("summary" if name == "meshgen_shard_seconds" else "gauge"), name
    assert len(read_rows(out)) == N
    expected = {
        "meshgen_samples_planned": N,
        "meshgen_samples_done": N,
        "meshgen_samples_failed": 0,
        "meshgen_shards_done": N // 2,
        "meshgen_shards_failed": 0,
    }
    assert {k: value(families, k) for k in expected} == expected
    m = record["metrics"]  # the same numbers in the run's record
    assert m["samples_done"] == N and m["shards_done"] == N // 2 and m["shard_seconds_count"] == N // 2
    assert value(families, "meshgen_images_per_second") == m["images_per_second"] > 0
    shard = {s.name: s.value for s in families["meshgen_shard_seconds"][1]}
    assert shard == {"meshgen_shard_seconds_count": N // 2, "meshgen_shard_seconds_sum": m["shard_seconds_sum"]}
    assert 0 < value(families, "meshgen_shard_last_seconds") == m["shard_last_seconds"]
    stages = {s.labels["stage"]: s.value for s in families["meshgen_stage_seconds"][1]}
    assert stages == m["stage_seconds"] == record["stages"] and stages["denoise"] > 0
    assert not [p.name for p in prom.parent.iterdir() if p != prom]  # no temporary file left beside it


@pytest.mark.parametrize("path", ["s3://bucket/meshgen.prom", "{tmp}/meshgen.txt"])
def test_a_metrics_path_a_collector_cannot_read_is_refused(path, tiny_model, tmp_path):
    path = path.format(tmp=tmp_path)
    res = launch("--dry-run", f"model.path={tiny_model}", f"output.dir={tmp_path / 'o'}", f"output.metrics={path}")
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and last.startswith(f"error: output.metrics={path} must be a local file path"), last


def test_prometheus_reads_labels_with_quotes_and_backslashes(tmp_path):
    from launcher.host.metrics import numbers, write_textfile

    out = 'C:\\runs\\"night"\nsecond line'
    values = numbers({0: {"status": "done", "rows": 3, "seconds": 2.0, "stages": {"denoise": 1.5}}}, 1.0)
    write_textfile(tmp_path / "m.prom", out, "r1", values, None)
    families = parse(tmp_path / "m.prom")
    assert value(families, "meshgen_samples_done", output=out, run_id="r1") == 3
    assert value(families, "meshgen_stage_seconds", output=out, stage="denoise") == 1.5
