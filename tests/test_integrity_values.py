"""Every value reaches the pipeline through a bounded, recorded path (issue 32, items 3-5), refused at the preflight:
`model.call_kwargs` may not set what has its own setting, and its numbers are finite; a LoRA's tensors are finite
and each of its keys names a layer; a row column the family's pipeline ignores is refused. Each refusal runs the
launcher's main() in this process as a dry run and (where it is cheap) a real run: exit 2, one last line.
"""

from __future__ import annotations

import inspect
import json

import pytest

from tools.make_tiny_lora import FLUX2, make_lora


def refused(launcher_main, capsys, args: list[str], *expected: str) -> str:
    code = launcher_main(args)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1] if err.strip() else ""
    assert code == 2, err[-3000:]
    assert "Traceback" not in err and last.startswith("error: "), last
    for e in expected:
        assert e in last, last
    return last


# (overrides, what the last line must name)
CALL_KWARGS = {
    "guidance-inf": (["+model.call_kwargs.guidance_scale=inf"], ["model.call_kwargs.guidance_scale: use generate."]),
    "steps-1e8": (["+model.call_kwargs.num_inference_steps=100000000"], ["use generate.num_inference_steps"]),
    "negative": (["+model.call_kwargs.negative_prompt=blur"], ["model.call_kwargs.negative_prompt", "column"]),
    "images": (["+model.call_kwargs.num_images_per_prompt=1000"], ["use generate.images_per_prompt"]),
    "true-cfg-nan": (["+model.call_kwargs.true_cfg_scale=nan"], ["true_cfg_scale=nan", "finite", "0 to 100"]),
    "true-cfg-swept": (
        ["+model.call_kwargs.true_cfg_scale=2", "generate.sweep={true_cfg_scale:[1.0,4.0]}"],
        ["model.call_kwargs.true_cfg_scale", "generate.sweep.true_cfg_scale"],
    ),
    "true-cfg-flux2": (["+model.call_kwargs.true_cfg_scale=4"], ["true_cfg_scale", "(flux2)", "generate.guidance"]),
    "temperature-inf": (["+model.call_kwargs.caption_upsample_temperature=inf"], ["temperature=inf", "finite"]),
    "list-nan": (["model.call_kwargs.text_encoder_out_layers=[1,nan]"], ["text_encoder_out_layers", "finite"]),
    "not-plain": (["+model.call_kwargs.attention_kwargs={scale:2}"], ["attention_kwargs", "not a plain value"]),
    "lora-scale-inf": (["model.loras=[{path:x.safetensors,scale:inf}]"], ["model.loras[0].scale=inf", "finite"]),
}


@pytest.mark.parametrize("case", list(CALL_KWARGS))
def test_call_kwargs_and_scales_outside_the_bounds_are_refused(case, tiny_model, tmp_path, launcher_main, capsys):
    overrides, expected = CALL_KWARGS[case]
    args = [f"model.path={tiny_model}", "mesh.tp=1", f"output.dir={tmp_path / 'out'}", *overrides]
    dry = refused(launcher_main, capsys, ["--dry-run", *args], *expected)
    assert refused(launcher_main, capsys, args) == dry  # the real run says the same line
    assert not (tmp_path / "out").exists()


def test_a_plain_call_kwarg_within_bounds_passes_and_is_recorded(tiny_model):
    """What the pipeline is called with is what run.json fingerprints (model.call_kwargs, as given)."""
    from launcher.checks.settings import check_settings
    from launcher.config import load_config
    from launcher.plan.shards import settings

    over = ["model.call_kwargs.text_encoder_out_layers=[1,2]", "+model.call_kwargs.caption_upsample_temperature=0.7"]
    cfg = load_config("tiny", [f"model.path={tiny_model}", *over])
    check_settings(cfg)
    got = settings(cfg)["model"]["call_kwargs"]
    assert got == {"text_encoder_out_layers": [1, 2], "caption_upsample_temperature": 0.7}


@pytest.fixture(scope="module")
def bad_loras(tiny_model, tmp_path_factory):
    """A LoRA whose lora_B is NaN throughout, and one with a misspelt component prefix and a misspelt block name."""
    import torch
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("bad-loras")
    good = make_lora(tiny_model, d / "good.safetensors", FLUX2, seed=1)
    sd = load_file(str(good))
    nan = dict(sd)
    key = "transformer.transformer_blocks.0.attn.to_q.lora_B.weight"
    nan[key] = torch.full_like(sd[key], float("nan"))
    save_file(nan, str(d / "nan.safetensors"))
    typo = dict(sd)
    for s in ("A", "B"):
        typo[f"transfomer.x_embedder.lora_{s}.weight"] = typo.pop(f"transformer.x_embedder.lora_{s}.weight")
        old = f"transformer.transformer_blocks.0.ff.linear_in.lora_{s}.weight"
        typo[old.replace("blocks", "blokcs")] = typo.pop(old)
    save_file(typo, str(d / "typo.safetensors"))
    return d, sd[key].numel()


@pytest.mark.parametrize("case", ["nan", "typo"])
def test_a_lora_with_non_finite_values_or_unmatched_keys_is_refused(case, bad_loras, tiny_model, launcher_main, capsys):
    d, n = bad_loras
    lora = d / f"{case}.safetensors"
    expected = {
        "nan": [str(lora), "'transformer.transformer_blocks.0.attn.to_q.lora_B.weight'", f"{n} non-finite"],
        # 4 of the 20 keys (7 transformer + 3 text encoder modules, A and B each)
        "typo": [
            str(lora),
            "4 of its 20 keys match no layer",
            "transfomer.x_embedder.lora_A.weight",
            "transformer.transformer_blokcs.0.ff.linear_in.lora_B.weight",
        ],
    }[case]
    args = [f"model.path={tiny_model}", "mesh.tp=1", f"model.loras=[{{path:{lora}}}]", f"output.dir={d / 'out'}"]
    refused(launcher_main, capsys, ["--dry-run", *args], *expected)
    assert not (d / "out").exists()


def test_every_family_declares_the_row_fields_its_pipeline_takes():
    """Held to the real diffusers pipelines' __call__ signatures: `seed` is the generator, the rest by name."""
    import diffusers

    from launcher.models import ROW_FIELDS, families
    from launcher.sources.prompts import OVERRIDE_COLUMNS

    assert set(ROW_FIELDS) == set(OVERRIDE_COLUMNS)
    for fam in families():
        for cls in fam.pipelines:
            params = set(inspect.signature(getattr(diffusers, cls).__call__).parameters) | {"seed"}
            assert set(fam.row_fields) == set(ROW_FIELDS) & params, (fam.name, cls)
            if set(fam.row_fields) != set(ROW_FIELDS) or fam.true_cfg:
                assert fam.row_hint, fam.name  # a refusal says what to do instead


@pytest.fixture(scope="module")
def negatives(tmp_path_factory):
    d = tmp_path_factory.mktemp("negatives")
    rows = [{"id": "a", "prompt": "a red cube"}, {"id": "b", "prompt": "a lake", "negative_prompt": "fog"}]
    (d / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d / "p.jsonl"


def test_a_negative_prompt_column_the_family_ignores_is_refused(negatives, tiny_model, tmp_path, launcher_main, capsys):
    args = [f"model.path={tiny_model}", "mesh.tp=1", f"dataset.path={negatives}", "dataset.id_column=id"]
    expected = [str(negatives), "column 'negative_prompt'", "id 'b'", "FLUX.2 takes no negative prompt"]
    refused(launcher_main, capsys, ["--dry-run", *args, f"output.dir={tmp_path / 'out'}"], *expected)
    refused(launcher_main, capsys, [*args, f"output.dir={tmp_path / 'out'}"], *expected)
    assert not (tmp_path / "out").exists()


def test_flux1_takes_a_negative_prompt_only_with_true_cfg(negatives, tiny_family, tmp_path, launcher_main, capsys):
    base = [
        "model=tiny_flux1",
        f"model.path={tiny_family('flux1')}",
        "mesh.tp=1",
        f"dataset.path={negatives}",
        "dataset.id_column=id",
        f"output.dir={tmp_path / 'out'}",
        "--dry-run",
    ]
    refused(launcher_main, capsys, base, "column 'negative_prompt'", "true_cfg_scale above 1")
    for extra in ("+model.call_kwargs.true_cfg_scale=4.0", "generate.sweep={true_cfg_scale:[1.0,4.0]}"):
        code = launcher_main([*base, extra])
        err = capsys.readouterr().err
        assert code == 0, err[-3000:]


# --- The preflight's checks (launcher/checks), each refusal's words and what each step hands the next.


def test_an_exception_chain_that_loops_is_followed_once():
    """download.py _root_cause: a chain that comes back to an exception already seen (a `raise a from b` made after
    `raise b from a`) ends there: the cause is found if it is on the loop, and a loop without one gives no gated or
    missing repo, in a bounded time (an alarm fails the test where the walk goes round for ever)."""
    import signal

    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    from launcher.checks.download import _root_cause

    def endless(*_):
        raise TimeoutError("the walk down the chain did not end")

    wanted = (GatedRepoError, RepositoryNotFoundError)
    a, b, c = OSError("a"), RuntimeError("b"), ValueError("c")
    a.__cause__, b.__cause__, c.__context__ = b, a, a  # a -> b -> a, and c -> a -> b -> a
    old = signal.signal(signal.SIGALRM, endless)
    timer = signal.setitimer(signal.ITIMER_REAL, 10.0)  # pytest-timeout's alarm, if any: set back after
    try:
        assert not isinstance(_root_cause(c, wanted), wanted)
        assert not isinstance(_root_cause(a, wanted), wanted)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if timer[0] > 0:
            signal.setitimer(signal.ITIMER_REAL, *timer)


def test_a_download_that_fails_names_the_first_line_of_its_error(tmp_path, monkeypatch):
    """download.py: a failure that is neither a gated nor a missing repo is one line naming the error's first line,
    or its type where it has no words."""
    import huggingface_hub
    from huggingface_hub import constants

    from launcher.checks import download
    from launcher.errors import ConfigError

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))  # nothing cached
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(download, "hub_answers", lambda *a: None)  # the hub answered
    for error, said in (
        (OSError("No space left on device\nwhile writing a blob"), "No space left on device"),
        (OSError(), "OSError"),
    ):

        def fail(*a, error=error, **kw):
            raise error

        monkeypatch.setattr(huggingface_hub, "hf_hub_download", fail)
        with pytest.raises(ConfigError) as e:
            download.ensure_downloaded("org/model")
        assert str(e.value) == (
            f"cannot download model.path org/model from {constants.ENDPOINT} ({said}); check the network, "
            "or download it elsewhere (hf download org/model) into HF_HOME"
        )


def test_a_pipeline_folder_without_a_class_name_is_called_this_pipeline(tmp_path):
    """A model_index.json that names no `_class_name` (a hand-made folder): the refusals call the model "this
    pipeline" (family generic): one that edits no references for job=edit, and one that has no LoRA loader."""
    import torch
    from safetensors.torch import save_file

    from launcher.checks.lora_checks import check_loras
    from launcher.checks.model_checks import check_model, locate
    from launcher.config import load_config
    from launcher.errors import ConfigError

    model, lora = tmp_path / "model", tmp_path / "lora.safetensors"
    model.mkdir()
    (model / "model_index.json").write_text(json.dumps({"_diffusers_version": "0.36.0"}))
    save_file({"transformer.x.lora_A.weight": torch.zeros(2, 2)}, str(lora))
    over = [f"model.path={model}", "model.build=null", "mesh.tp=1"]
    cfg = load_config("tiny", [*over, "job=edit"])
    found = locate(cfg)
    assert (found.root, found.what, found.family.name) == (model, "this pipeline", "generic")
    with pytest.raises(ConfigError) as e:
        check_model(cfg, found)
    assert str(e.value).startswith("job=edit: this pipeline does not take reference images (family generic); ")
    with pytest.raises(ConfigError) as e:
        check_loras(load_config("tiny", [*over, f"model.loras=[{{path:{lora}}}]"]), model)
    assert str(e.value) == (
        "model.loras: diffusers has no LoRA loader for this pipeline (family generic); remove model.loras, or use a "
        "model whose pipeline loads LoRAs"
    )


def test_a_dry_run_of_a_tiny_model_not_yet_built_learns_its_configs_from_a_build_it_removes(
    tiny_model, tmp_path, monkeypatch, capfd
):
    """preflight.py's words: a dry run of the tiny model still to be built learns its configs from a build in a
    temporary folder (quietly: the build's lines are not a dry run's), and logging works as before after it; a real
    run's preflight builds nothing before `fetch`, which builds it at its own location."""
    import logging

    from launcher.checks import family_checks
    from launcher.checks.model_checks import locate
    from launcher.checks.preflight import Preflight, model
    from launcher.config import load_config

    own = tmp_path / "models" / "tiny-flux2"
    monkeypatch.setattr(family_checks, "default_dir", lambda build: tmp_path / "models" / build.replace("_", "-"))
    cfg = load_config("tiny", [f"model.path={own}"])  # conf tiny: model.build=tiny_flux2
    index = json.loads((tiny_model / "model_index.json").read_text())
    expected = {
        name: (spec[0], spec[1], json.loads((tiny_model / name / "config.json").read_text()))
        for name, spec in index.items()
        if isinstance(spec, list) and (tiny_model / name / "config.json").is_file()
    }
    capfd.readouterr()
    pf = Preflight(cfg, dry_run=True)
    model(pf)
    assert capfd.readouterr().err == ""
    assert (pf.model.root, pf.model.what, pf.model.family.name) == (None, "the tiny Flux2Pipeline", "flux2")
    assert pf.model.configs == expected
    assert not own.exists()  # nothing built where the real run builds it
    assert logging.root.manager.disable == logging.NOTSET
    real = locate(cfg)
    assert (real.what, real.family.name, real.configs) == ("the tiny Flux2Pipeline", "flux2", None)


def test_two_way_tensor_parallel_must_divide_the_sharded_heads(tiny_model):
    """model_checks.py: mesh.tp=2 (the smallest tp that shards) is held to the sharded heads like any other tp."""
    from launcher.checks.model_checks import check_model, locate
    from launcher.config import load_config
    from launcher.errors import ConfigError

    cfg = load_config("tiny", [f"model.path={tiny_model}", "mesh.tp=2", "model.shard_text_encoder=false"])
    model = locate(cfg)
    check_model(cfg, model)  # the tiny transformer's 2 heads
    lib, cls, config = model.configs["transformer"]
    model.configs["transformer"] = (lib, cls, {**config, "num_attention_heads": 3})
    with pytest.raises(ConfigError) as e:
        check_model(cfg, model)
    assert str(e.value) == "mesh.tp=2 does not divide the transformer's num_attention_heads=3; use a tp that divides 3"


def test_sizes_follow_the_transformers_own_patch_and_the_largest_swept_size():
    """model_checks.py: the size factor is the VAE's scale times the larger of the transformer's patch_size and the
    family's packing (2): a VAE of 4 levels (scale 8) with a patch of 4 makes 32; with no VAE known, any size goes
    (a factor of 1); a row that sets one side is checked against the largest value the other side is swept to."""
    from launcher.checks.model_checks import Model, size_multiple, size_rule
    from launcher.config import load_config
    from launcher.models import GENERIC

    vae = ("diffusers", "AutoencoderKL", {"block_out_channels": [8, 16, 32, 32]})
    patched = {"vae": vae, "transformer": ("diffusers", "SomeTransformer", {"patch_size": 4})}
    assert size_multiple(Model("m", None, GENERIC, "this pipeline", patched)) == 32
    cfg = load_config("tiny", ["generate.height=512", "generate.width=256", "generate.sweep={height:[256,1024]}"])
    unknown = size_rule(cfg, Model("org/m", None, None, "this pipeline", None))
    assert (unknown.multiple, unknown.height, unknown.width) == (1, 1024, 256)


def test_the_mesh_planned_again_after_the_fetch_keeps_what_auto_chose(tiny_model):
    """preflight.py mesh: a hub id not known before `fetch` has its mesh planned twice; the first plan wrote
    `auto`'s choice into the config, so the second has none of its own, and the first one's reasons are kept:
    they are what tells the workers the launcher's numbers (prepare.worker_overrides)."""
    from launcher.checks.model_checks import Model, locate
    from launcher.checks.preflight import Preflight, mesh
    from launcher.config import load_config

    over = [f"model.path={tiny_model}", "mesh.tp=1", "mesh.dp=auto", "mesh.chip=cpu", "mesh.chip_memory_gib=64"]
    pf = Preflight(load_config("tiny", over))
    pf.device, pf.model = "cpu", Model("org/m", None, None, "this pipeline", None)  # before the fetch
    mesh(pf)
    chose = ["dp=auto chose 1: 1 chips per host / tp 1"]
    assert pf.mesh.why == chose
    pf.model = locate(pf.cfg)  # after it: the configs are known
    mesh(pf)
    assert pf.mesh.why == chose and (pf.cfg.mesh.dp, pf.cfg.mesh.tp) == (1, 1)


def test_a_real_run_of_a_model_known_before_the_fetch_checks_it_once(tiny_model, tmp_path, monkeypatch):
    """preflight.py fetch: the steps that need the model's configs run again after `fetch` only where nothing was
    known before it; a local folder is known, so each step runs once."""
    from launcher.checks import preflight as pre
    from launcher.config import load_config

    ran = []
    step = pre.run_step
    monkeypatch.setattr(pre, "run_step", lambda pf, s: ran.append(s.name) or step(pf, s))
    cfg = load_config("tiny", [f"model.path={tiny_model}", "mesh.tp=1", f"output.dir={tmp_path / 'out'}"])
    pre.preflight(cfg)
    assert ran == [s.name for s in pre.STEPS]


def test_a_dry_run_notes_a_model_it_knows_nothing_of_and_only_such_a_model(tiny_model, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from launcher.checks.preflight import preflight
    from launcher.config import load_config

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))  # nothing cached
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    over = ["mesh.tp=1", "model.build=null", f"output.dir={tmp_path / 'out'}"]
    known = preflight(load_config("tiny", [f"model.path={tiny_model}", *over]), dry_run=True)
    assert not any(n.startswith("# model:") for n in known.notes), known.notes
    unknown = preflight(load_config("tiny", ["model.path=org/not-in-the-table", *over]), dry_run=True)
    assert unknown.notes[-1] == (
        "# model: org/not-in-the-table is neither on this host nor in the published checkpoints' table; the real run "
        "downloads it first, then checks the mesh, its heads and sizes against its configs"
    )


def test_the_output_step_refuses_a_folder_inside_the_source_and_one_made_with_other_settings(tiny_model, tmp_path):
    """preflight.py output: an output.dir the source would read back is refused before anything is written; a
    folder whose run.json has other settings is refused unless run.overwrite=true."""
    from launcher.checks.preflight import Preflight, output
    from launcher.config import load_config
    from launcher.errors import ConfigError
    from launcher.ledger.runs import write_run_json
    from launcher.ledger.store import Store

    src = tmp_path / "src"
    src.mkdir()
    (src / "p.txt").write_text("a red cube\n")
    inside = src / "out"
    cfg = lambda *o: load_config("tiny", [f"model.path={tiny_model}", "mesh.tp=1", *o])  # noqa: E731
    with pytest.raises(ConfigError) as e:
        output(Preflight(cfg(f"dataset.path={src}", f"output.dir={inside}")))
    assert str(e.value).startswith(f"output.dir {inside} is inside dataset.path {src}'s reach")
    assert not inside.exists()
    out = tmp_path / "out"
    write_run_json(Store(out), cfg(f"output.dir={out}", "generate.seed=5"), 2)
    with pytest.raises(ConfigError, match=r"other settings \(generate\.seed: 5 -> 6\)"):
        output(Preflight(cfg(f"output.dir={out}", "generate.seed=6")))
    output(Preflight(cfg(f"output.dir={out}", "generate.seed=6", "run.overwrite=true")))


def test_the_prompts_step_finds_a_done_shard_whose_files_are_gone(tiny_model, tmp_path):
    """preflight.py prompts: the plan is made against the output folder's listing, so a done shard whose recorded
    files are missing is planned as damaged (and generated again), not as done."""
    from launcher.checks.preflight import Preflight, prompts
    from launcher.config import load_config
    from launcher.ledger.store import Store

    out = tmp_path / "out"
    pf = Preflight(load_config("tiny", [f"model.path={tiny_model}", "mesh.tp=1", f"output.dir={out}"]))
    pf.store = Store(out)
    pf.store.write_json("state/shard-00000.json", {"status": "done", "rows": 4, "files": {"data/x.parquet": [10]}})
    prompts(pf)
    assert pf.plan.shards[0].status == "damaged"


def test_the_rendezvous_port_is_checked_only_for_a_job_over_several_hosts(monkeypatch):
    """preflight.py store_port and settings.py check_store_port: a one-host job binds no port of its own (a busy
    MASTER_PORT does not matter to it); a job over several hosts without NODE_RANK set is the first host's (torch's
    default rank 0); a host without IPv6 still checks IPv4."""
    import errno
    import socket

    from launcher.checks.preflight import Preflight, store_port
    from launcher.config import load_config
    from launcher.errors import ConfigError

    class NoIPv6(socket.socket):
        def bind(self, address):
            if self.family == socket.AF_INET6:
                raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
            return super().bind(address)

    monkeypatch.delenv("NODE_RANK", raising=False)
    one, two = (Preflight(load_config("tiny", [f"mesh.nodes={n}", "mesh.dp=2", "mesh.tp=1"])) for n in (1, 2))
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        monkeypatch.setenv("MASTER_PORT", str(held.getsockname()[1]))
        store_port(one)
        with monkeypatch.context() as m:
            m.setattr(socket, "socket", NoIPv6)
            with pytest.raises(ConfigError, match="cannot be bound on this host"):
                store_port(two)
    store_port(two)  # free now


def test_an_object_store_output_names_the_extra_it_needs_and_what_to_check_when_it_cannot_be_reached(monkeypatch):
    """settings.py check_object_store: a client library that is not installed is one line naming it and the pip
    extra that brings it (the scheme is what comes before the first ://); a store that cannot be reached names its
    first line and where the credentials come from."""
    import sys

    from launcher.checks.settings import check_object_store
    from launcher.errors import ConfigError
    from launcher.ledger import store

    def refusal(url: str) -> str:
        with pytest.raises(ConfigError) as e:
            check_object_store(url)
        return str(e.value)

    with monkeypatch.context() as m:  # not installed, as the import system sees it
        m.setitem(sys.modules, "boto3", None)
        m.setitem(sys.modules, "google", None)
        for name in ("google.cloud", "google.cloud.storage"):
            m.delitem(sys.modules, name, raising=False)
        assert refusal("s3://bucket/runs://1") == 'output.dir=s3://bucket/runs://1 needs boto3: pip install -e ".[s3]"'
        gcs = 'output.dir=gs://bucket/x needs google.cloud.storage: pip install -e ".[gcs]"'
        assert refusal("gs://bucket/x") == gcs

    def unreachable(url):
        raise OSError("Unable to locate credentials\nfor the bucket")

    monkeypatch.setattr(store, "open_uri", unreachable)
    assert refusal("s3://bucket/x") == (
        "output.dir=s3://bucket/x cannot be reached (Unable to locate credentials); check the bucket name and the "
        "credentials (the AWS_* variables, or gcloud application default credentials; STORAGE_EMULATOR_HOST for a "
        "local GCS server)"
    )


def test_an_output_folder_that_cannot_take_a_file_says_what_to_do():
    """settings.py check_output: /proc takes no file, even as root: one line naming the folder, its error, the fix."""
    from launcher.checks.settings import check_output
    from launcher.config import load_config
    from launcher.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        check_output(load_config("tiny", ["output.dir=/proc/meshgen-out"]))
    line = str(e.value)  # the error's words are the kernel's
    assert line.startswith("output.dir /proc/meshgen-out cannot be written (creating a file in /proc fails: ")
    assert line.endswith("); choose another folder or fix its permissions") and "\n" not in line


def test_a_quality_model_with_safetensors_is_fetched_without_its_pickle_and_a_failure_is_cut(tmp_path, monkeypatch):
    """quality_models.py: a repo with safetensors weights is fetched without its PyTorch pickle (not even asked for;
    its bytes differ, so the cache cannot stand in for a download); a download that fails is one line, its error's
    first line cut at 200 characters."""
    import httpx2
    import huggingface_hub
    from fake_hub import FakeHub, Repo, serve
    from huggingface_hub import constants, hf_api
    from huggingface_hub.errors import HfHubHTTPError
    from omegaconf import OmegaConf

    from launcher.checks.quality_models import fetch_quality_models
    from launcher.errors import ConfigError

    hub = FakeHub()
    files = {"config.json": b"{}", "model.safetensors": b"safetensors weights", "pytorch_model.bin": b"pickled"}
    hub.repos["org/both"] = Repo(files)
    server = serve(hub)
    template = constants.HUGGINGFACE_CO_URL_TEMPLATE.replace(constants.ENDPOINT, hub.url, 1)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(hf_api.api, "endpoint", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 2)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_TOKEN", "")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    q = OmegaConf.create({"quality": {"clip_score": True, "clip_model": "org/both", "safety": False}})

    def refused(*a, **kw):
        answer = httpx2.Response(401, request=httpx2.Request("GET", hub.url))
        raise HfHubHTTPError("4" * 300 + "\nthe rest", response=answer)

    try:
        fetch_quality_models(q)
        assert [p for _, p in hub.log if "/resolve/" in p and p.endswith("model.safetensors")]
        assert not [p for _, p in hub.log if p.endswith("pytorch_model.bin")]
        monkeypatch.setattr(huggingface_hub, "snapshot_download", refused)
        with pytest.raises(ConfigError) as e:
            fetch_quality_models(q)
    finally:
        server.shutdown()
    assert str(e.value) == (
        f"quality.clip_model=org/both cannot be downloaded ({'4' * 200}); check the id and your HF_TOKEN"
    )


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ("{mag_ratios:[]}", "index is out of bounds for dimension with size 0"),
        ("{mag_ratios:[1.0,2.0],num_inference_steps:-1}", "upper bound and lower bound inconsistent with step sign"),
    ],
)
def test_magcache_ratios_torch_cannot_use_are_one_line(options, said, tiny_model):
    """family_checks.py check_cache: MagCacheConfig turns mag_ratios into a tensor and interpolates it to the steps;
    torch's IndexError or RuntimeError there is a refusal of the options like diffusers' own errors, not a crash."""
    from launcher.checks.family_checks import check_cache
    from launcher.config import load_config
    from launcher.errors import ConfigError
    from launcher.models import family_of_folder

    cfg = load_config(
        "tiny", [f"model.path={tiny_model}", "execution.cache=magcache", f"+execution.cache_options={options}"]
    )
    with pytest.raises(ConfigError) as e:
        check_cache(cfg, family_of_folder(tiny_model))
    assert str(e.value).startswith(
        "execution.cache_options="
    ) and f"MagCacheConfig ({said}); fix or remove them" in str(e.value)
