"""Images per prompt, staged execution and step caching, through launch.sh on the tiny FLUX.2, images read back."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import bare_flux2, contract_seed, launch, pixels, read_rows

from launcher.config import load_config
from launcher.errors import ConfigError
from launcher.plan.shards import check_sample_ids, settings, settings_fingerprint

IDS = ["cat", "dog", "a-5", "tree", "sky"]  # 3 shards of 2 prompts, the last one padded
ROW_SEEDS = {"dog": 11, "tree": 2**63 - 1}  # the rows' own `seed` column; the others have none
N = 2


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("speed") / "p.jsonl"
    rows = [{"key": i, "prompt": f"a photo of {i}", **({"seed": ROW_SEEDS[i]} if i in ROW_SEEDS else {})} for i in IDS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def job(run_job, prompts):
    def run(*extra: str):
        base = (
            f"dataset.path={prompts}",
            "dataset.id_column=key",
            "run.shard_size=2",
            f"generate.images_per_prompt={N}",
        )
        return run_job(*base, *extra)

    return run


# Each sample's seed from the contract's words (job seed 0): sha256("0:<prompt id>-<k>"); where the row has its own
# seed, the README's rule for N > 1: sha256("<row seed>:<k>").
SEEDS = {
    f"{i}-{k}": contract_seed(ROW_SEEDS[i], str(k)) if i in ROW_SEEDS else contract_seed(0, f"{i}-{k}")
    for i in IDS
    for k in range(N)
}


def _diff(a, b) -> int:
    ra, rb = read_rows(a), read_rows(b)
    assert ra.keys() == rb.keys()
    return max(int(np.abs(pixels(ra[k]["image"]["bytes"]) - pixels(rb[k]["image"]["bytes"])).max()) for k in ra)


def test_n_images_per_prompt_equal_the_bare_diffusers_call(job, tiny_model):
    out = job("mesh.tp=1", "generate.batch_size=1")
    rows = read_rows(out)
    assert sorted(rows) == sorted(f"{i}-{k}" for i in IDS for k in range(N))
    assert all(r["prompt_id"] == r["id"].rsplit("-", 1)[0] and r["seed"] == SEEDS[r["id"]] for r in rows.values())
    state = json.loads((out / "state" / "shard-00002.json").read_text())
    assert (state["rows"], state["prompts"]) == (N, 1)  # images, and the prompts they came from
    for pid in IDS:
        ids = [f"{pid}-{k}" for k in range(N)]
        images = bare_flux2(tiny_model, [SEEDS[i] for i in ids], prompt=f"a photo of {pid}", num_images_per_prompt=N)
        for i, image in zip(ids, images, strict=True):
            assert np.array_equal(pixels(rows[i]["image"]["bytes"]), image), i


def test_dp_batch_size_staging_and_offload_change_images_by_2_levels_at_most(job):
    # batch size changes the order of floating-point sums (1 level measured); dp alone is bitwise (test_job.py)
    ref = job("mesh.tp=1", "generate.batch_size=1")
    other = job("mesh.tp=1", "mesh.dp=2", "generate.batch_size=2", "execution.staged=true", "execution.offload=model")
    assert _diff(ref, other) <= 2


def test_batches_of_several_prompts_and_images_keep_each_samples_seed(job):
    """Batches of 2 prompts x 2 images (conf tiny's batch size), staged and not, rows with and without their own
    seed: every sample's `seed` is its own (a wrong index into a batch's seeds shows only with both > 1), and its
    image was made with it (the images equal batch size 1's: test_dp_batch_size_... and test_staged_...)."""
    assert SEEDS["cat-0"] == 4293366858092544584 and SEEDS["sky-1"] == 1437267233648433379  # hashlib's, written out
    options = ("+execution.cache_options.cache_interval=2", "+execution.cache_options.disable_cache_before_step=1")
    for out in (
        job("mesh.tp=1", "mesh.dp=2", "generate.batch_size=2", "execution.staged=true", "execution.offload=model"),
        job("execution.staged=true"),
        job("execution.cache=taylorseer", *options),  # unstaged
    ):
        rows = read_rows(out)
        assert {k: (r["seed"], r["prompt_id"]) for k, r in rows.items()} == {k: (s, k[:-2]) for k, s in SEEDS.items()}


def test_staged_on_a_tp_mesh_matches_tp1_within_2_levels(job):
    assert _diff(job("mesh.tp=1", "generate.batch_size=1"), job("execution.staged=true")) <= 2


def test_staged_parks_the_model_a_stage_does_not_use_and_matches_unstaged_bitwise(tiny_model):
    """While prompts are encoded the transformer holds no weights on the chip, while they are denoised and
    decoded the text encoder holds none; the images equal the unstaged ones bit for bit (the tiny pipeline, in
    this process)."""
    from diffusers import Flux2Pipeline

    from jobs.text_to_image import make_batches
    from launcher.worker.staged import shard_steps

    cfg = load_config("tiny", [f"model.path={tiny_model}", "execution.staged=true", "generate.batch_size=1"])
    pipe = Flux2Pipeline.from_pretrained(tiny_model)
    pipe.set_progress_bar_config(disable=True)
    full = {m: sum(p.numel() for p in getattr(pipe, m).parameters()) for m in ("text_encoder", "transformer")}
    rows = [{"id": "a", "prompt": "a cat"}, {"id": "b", "prompt": "a dog"}]
    unstaged = [  # first: the staged run leaves the text encoder parked for the next shard
        s
        for _, step in shard_steps(
            pipe,
            make_batches(rows, cfg.generate),
            load_config("tiny", [f"model.path={tiny_model}", "generate.batch_size=1"]),
        )
        for s in step()
    ]
    seen, staged = [], []
    steps = shard_steps(pipe, make_batches(rows, cfg.generate), cfg)
    for _, step in steps:
        staged += step()
        images = len(staged)
        on_chip = {m: sum(p.numel() for p in getattr(pipe, m).parameters()) for m in full}
        seen.append((images, on_chip["text_encoder"] == full["text_encoder"], on_chip["transformer"]))
    steps.close()
    assert seen == [(0, True, 0)] * 2 + [(0, False, full["transformer"])] * 2 + [(1, False, full["transformer"])] + [
        (2, False, full["transformer"])
    ]
    assert all(p.numel() == 0 for p in pipe.text_encoder.parameters())  # parked between shards too
    assert [s["id"] for s in unstaged] == [s["id"] for s in staged] == ["a", "b"]
    for a, b in zip(staged, unstaged, strict=True):
        assert np.array_equal(a["pixels"], b["pixels"]), a["id"]


def test_taylorseer_changes_the_images_and_every_tp_rank_agrees(job):
    # At tp=2: a run whose ranks took different cache decisions fails its shards (launch would exit 3).
    options = ("+execution.cache_options.cache_interval=2", "+execution.cache_options.disable_cache_before_step=1")
    cached = job("execution.cache=taylorseer", *options)
    assert 0 < _diff(job("execution.staged=true"), cached)


def test_resuming_with_another_n_or_cache_exits_2(job, tiny_model, launcher_main, capsys):
    out = job("mesh.tp=1", "generate.batch_size=1")
    base = [f"model.path={tiny_model}", f"output.dir={out}", "mesh.tp=1"]
    for change, line in (  # in this process: each is the launcher's refusal before any worker starts
        (["generate.images_per_prompt=3"], "generate.images_per_prompt: 2 -> 3"),
        ([f"generate.images_per_prompt={N}", "execution.cache=taylorseer"], "execution.cache: 'none' -> 'taylorseer'"),
    ):
        code = launcher_main([*base, *change])
        err = capsys.readouterr().err
        assert code == 2 and line in err.strip().splitlines()[-1], err[-2000:]


def test_unsupported_cache_and_colliding_ids_are_refused(tiny_model, tmp_path):
    res = launch(f"model.path={tiny_model}", f"output.dir={tmp_path / 'a'}", "execution.cache=first_block")
    assert res.returncode == 2 and "execution.cache=first_block is not supported" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    (tmp_path / "p.txt").write_text("x\n")
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"key": k, "prompt": "p"}) + "\n" for k in ("a", "b", "a-1")))
    res = launch(
        f"model.path={tiny_model}", f"output.dir={tmp_path / 'b'}", f"dataset.path={src}", "dataset.id_column=key",
        "generate.images_per_prompt=2",
    )  # fmt: skip
    assert res.returncode == 2 and "prompt 'a' has a sample id 'a-1'" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "b").exists()


def test_sample_id_collisions_in_either_order():
    check_sample_ids(["a", "a-1"], 1)
    check_sample_ids(["a", "a-2", "a-01", "b-1"], 2)  # a-2 and a-01 are not samples of a with N=2
    for ids in (["a", "a-1"], ["a-1", "a"], ["a-0", "x", "a"]):
        with pytest.raises(ConfigError, match="is also the id of another prompt"):
            check_sample_ids(ids, 2)


def test_defaults_keep_old_fingerprints_and_n_or_cache_change_them():
    cfg = load_config("tiny")
    assert "images_per_prompt" not in settings(cfg)["generate"] and "execution" not in settings(cfg)
    fps = {settings_fingerprint(load_config("tiny", o)) for o in ([], ["generate.images_per_prompt=2"])}
    fps |= {settings_fingerprint(load_config("tiny", ["execution.cache=taylorseer"]))}
    fps |= {settings_fingerprint(load_config("tiny", ["execution.staged=true", "generate.batch_size=7"]))}
    assert len(fps) == 3  # staging and batch size decide how, not what


# Imported first by every Python process that has its folder on PYTHONPATH: in the worker of rank 1 (torch elastic
# sets RANK before the worker's code runs), each batch's images come out one level off in one pixel, as if that rank
# had taken other cache decisions. RANK is read at each call, not at import: forked workers share the imports of a
# server that started before any rank existed.
DIVERGE = """
import importlib.abc, importlib.machinery, os, sys

class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "launcher.worker.runner":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            inner = module.shard_steps

            def shard_steps(*a, **k):
                steps = inner(*a, **k)
                if os.environ.get("RANK") != "1":
                    return steps
                return _diverged(steps)

            def _diverged(steps):
                try:
                    for batch, step in steps:
                        yield batch, (lambda step=step, **kw: [_off(s) for s in step(**kw)])
                finally:
                    steps.close()

            module.shard_steps = shard_steps

        spec.loader.exec_module = exec_module
        return spec

def _off(sample):
    sample["pixels"] = sample["pixels"].copy()
    sample["pixels"][0, 0, 0] ^= 1
    return sample

sys.meta_path.insert(0, _Hook())
"""


def test_a_tp_rank_with_other_images_fails_the_shard(tiny_model, tmp_path):
    """Under step caching the tp ranks compare a hash of each batch's images: a rank whose images differ (here
    made so on rank 1) fails the shard, though the writer (rank 0) alone would have written good-looking images."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(DIVERGE)
    res = launch(
        f"model.path={tiny_model}", f"output.dir={tmp_path / 'out'}", "dataset.limit=2", "run.shard_size=2",
        "execution.cache=taylorseer", "+execution.cache_options.cache_interval=2", env={"PYTHONPATH": str(hook)},
    )  # fmt: skip
    assert res.returncode == 3, res.stderr[-2000:]
    state = json.loads((tmp_path / "out" / "state" / "shard-00000.json").read_text())
    assert state["status"] == "failed" and "different step-cache decisions" in state["error"]
