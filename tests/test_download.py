"""A hub id not in the cache is downloaded by the launcher, once, only what the pipeline loads; gated repos exit 2.

The hub is a local server on 127.0.0.1 (tests/fake_hub.py) reached through HF_ENDPOINT, serving the tiny FLUX.2
pipeline plus a large single-file checkpoint at the repo's root that the pipeline does not load.
"""

from collections import Counter

import pytest
from conftest import launch, read_rows
from fake_hub import FakeHub, serve

REPO, GATED = "meshgen-test/tiny-flux2", "meshgen-test/gated-flux2"
SINGLE_FILE = "flux2-tiny-all-in-one.safetensors"


@pytest.fixture(scope="module")
def hub(tiny_model):
    hub = FakeHub()
    hub.add_folder(REPO, tiny_model, extra={SINGLE_FILE: b"\0" * (16 << 20)})
    hub.add_folder(GATED, tiny_model, gated=True)
    server = serve(hub)
    yield hub
    server.shutdown()


def hub_env(hub, home, **extra):
    # No token, no stored login, nothing cached: a fresh host.
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_TOKEN": "", **extra}


def test_a_hub_id_is_downloaded_once_with_only_the_files_the_pipeline_loads(hub, tmp_path):
    env, out = hub_env(hub, tmp_path / "hf"), tmp_path / "out"
    job = [f"model.path={REPO}", "model.build=null", "dataset.limit=2", f"output.dir={out}"]
    res = launch(*job, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Fetching" in res.stderr  # huggingface_hub's progress bar
    assert len(read_rows(out)) == 2
    got = [p.rsplit("/resolve/", 1)[1].split("/", 1)[1] for p in hub.requested("GET") if "/resolve/" in p]
    assert SINGLE_FILE not in got and not any(SINGLE_FILE in p for p in hub.requested("HEAD"))
    for part in ("transformer", "vae"):
        assert got.count(f"{part}/diffusion_pytorch_model.safetensors") == 1  # once, by the launcher
    assert got.count("text_encoder/model.safetensors") == 1
    for method in ("GET", "HEAD"):  # each asked once, by the launcher: the workers ask the hub nothing (offline)
        asked = Counter(hub.requested(method))
        if method == "GET":  # and the repo's info twice: the launcher's bounded first request, then the download's
            assert asked.pop(f"/api/models/{REPO}") == 2, asked
        assert set(asked.values()) == {1}, (method, asked)
    snapshot = next((tmp_path / "hf" / "hub").glob("models--meshgen-test--tiny-flux2/snapshots/*"))
    assert (snapshot / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    assert not (snapshot / SINGLE_FILE).exists()
    # The same command again, with the cache complete: no request at all (a host without network runs from its
    # cache). Its workers would load from the cache as the first run's did (each file fetched once, by the launcher).
    before = len(hub.log)
    res = launch(*job, env=env)
    assert res.returncode == 0 and "nothing to do" in res.stderr, res.stderr[-3000:]
    assert hub.log[before:] == []


@pytest.mark.parametrize("token", ["", "hf_not_accepted"])
def test_a_gated_repo_says_how_to_log_in_and_where_to_accept(hub, tmp_path, token):
    out = tmp_path / "out"
    res = launch(
        f"model.path={GATED}",
        "model.build=null",
        f"output.dir={out}",
        env=hub_env(hub, tmp_path / "hf", HF_TOKEN=token),
    )
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert lines[-1] == (
        f"error: model.path {GATED} is a gated repo: log in (hf auth login, or set HF_TOKEN) with an account that "
        f"accepted its license at {hub.url}/{GATED}"
    )
    assert "Traceback" not in res.stderr and not out.exists()
    assert not any(p.startswith(f"/{GATED}/") and p.endswith(".safetensors") for p in hub.requested("GET"))


def test_an_unknown_hub_id_is_one_line(hub, tmp_path):
    res = launch("model.path=meshgen-test/no-such-model", "model.build=null", env=hub_env(hub, tmp_path / "hf"))
    assert res.returncode == 2
    assert "is not a repo on" in res.stderr.strip().splitlines()[-1] and "Traceback" not in res.stderr
