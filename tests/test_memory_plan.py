"""Memory planning without weights: parameter counts, per-rank bytes, the `# mesh:` line, auto, refusals."""

import json
import re
import struct

import pytest
from conftest import PROMPTS, launch

from launcher.models.checkpoints import PUBLISHED
from launcher.sizing import memory

MESH_LINE = re.compile(
    r"# mesh: dp=(\d+) tp=(\d+) \((\w+), ([\d.]+) GiB per chip; per rank: transformer ([\d.e-]+) GiB, "
    r"text_encoder ([\d.e-]+) GiB, vae ([\d.e-]+) GiB\)"
)


@pytest.fixture(scope="module", autouse=True)
def fresh_count_cache(tmp_path_factory):
    """Counted in this module (and its launches), never read from a cache that another version filled."""
    import os

    old = os.environ.get("MESHGEN_CACHE_DIR")
    os.environ["MESHGEN_CACHE_DIR"] = str(tmp_path_factory.mktemp("count-cache"))
    yield
    os.environ.pop("MESHGEN_CACHE_DIR") if old is None else os.environ.__setitem__("MESHGEN_CACHE_DIR", old)


def safetensors_numel(folder) -> int:
    """Parameters stored in a component folder, from the safetensors headers alone."""
    total = 0
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, t in header.items():
            if name != "__metadata__":
                n = 1
                for d in t["shape"]:
                    n *= d
                total += n
    return total


def test_meta_counts_equal_the_tiny_models_saved_parameters(tiny_model):
    comps = memory.components(str(tiny_model), tiny_model)
    assert set(comps) == {"transformer", "text_encoder", "vae"}
    for name, comp in comps.items():
        assert memory.counts(comp).total == safetensors_numel(tiny_model / name), name


def test_sharded_count_of_the_tiny_text_encoder_follows_its_tp_plan(tiny_model):
    # By hand from the config: q/k/v/o and the three MLP projections of each layer, and the embedding (tied to
    # lm_head) are in transformers' plan; norms and the vision tower are not.
    text = json.loads((tiny_model / "text_encoder" / "config.json").read_text())["text_config"]
    h, d, heads, kv, ff = (
        text[k] for k in ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    )
    per_layer = h * heads * d * 2 + h * kv * d * 2 + 3 * h * ff
    expected = per_layer * text["num_hidden_layers"] + text["vocab_size"] * h
    comp = memory.components(str(tiny_model), tiny_model)["text_encoder"]
    assert memory.counts(comp).sharded == expected


def test_flux2_dev_transformer_per_rank_matches_the_measured_plan():
    # FINDINGS: 32.2B parameters, 97.5% in sharded layers, about 30.8 GiB bf16 per rank at tp=2, 16.1 at tp=4.
    c = memory.counts(PUBLISHED["black-forest-labs/FLUX.2-dev"]["transformer"])
    assert round(c.total / 1e9, 1) == 32.2 and round(c.sharded / c.total, 3) == 0.975
    assert round(c.rank_bytes(2, "bfloat16", True) / memory.GIB, 1) == 30.8
    assert round(c.rank_bytes(4, "bfloat16", True) / memory.GIB, 1) == 16.1
    assert c.rank_bytes(4, "bfloat16", False) == c.rank_bytes(1, "bfloat16", True) == c.total * 2


def test_t5_keeps_its_wo_in_float32_only_for_float16():
    c = memory.counts(PUBLISHED["black-forest-labs/FLUX.1-schnell"]["text_encoder_2"])
    assert c.sharded == 0  # transformers has no TP plan for T5
    assert c.fp32_half == 24 * 4096 * 10240  # the wo of 24 layers of d_model x d_ff
    assert c.rank_bytes(8, "float16", True) - c.rank_bytes(8, "bfloat16", True) == 2 * c.fp32_half


def test_what_is_on_the_chip_together():
    from omegaconf import OmegaConf

    from launcher.sizing.mesh_plan import need_gib

    per_rank = {"transformer": 10 * memory.GIB, "text_encoder": 6 * memory.GIB, "vae": memory.GIB}
    base = {"generate": {"batch_size": 1, "height": 1024, "width": 1024}}
    for execution, weights in (
        ({"offload": "none"}, 17),
        ({"offload": "none", "staged": True}, 11),  # the text encoder and the transformer take turns
        ({"offload": "model"}, 10),
    ):
        cfg = OmegaConf.create({**base, "execution": execution})
        assert need_gib(cfg, per_rank) == weights + 2.0  # + 2 GiB per megapixel of a batch


@pytest.fixture
def mesh_lines(launcher_main, capsys):
    """mesh_lines(*overrides) -> the `# mesh:` lines of a dry run of conf=flux2_tp, run in this process."""

    def run(*args):
        code = launcher_main(["--dry-run", "conf=flux2_tp", PROMPTS, *args])
        out = capsys.readouterr()
        assert code == 0, out.err
        return [ln for ln in out.out.splitlines() if ln.startswith("# mesh:")]

    return run


def test_dry_run_prints_the_mesh_line_of_flux2_dev_on_a_v6e(mesh_lines):
    line = mesh_lines()[0]
    m = MESH_LINE.fullmatch(line)
    assert m, line
    assert m.groups()[:4] == ("1", "8", "v6e", "32")
    assert m.group(5) == "8.8"  # (31.4B sharded / 8 + 0.8B replicated) x 2 bytes


@pytest.mark.parametrize(("chip", "tp", "dp"), [("v6e", 8, 1), ("h200", 1, 8)])
def test_auto_picks_the_smallest_tp_that_fits(chip, tp, dp, mesh_lines):
    device = {"v6e": "tpu", "h200": "cuda"}[chip]  # the chip's own device (else exit 2)
    lines = mesh_lines("mesh.tp=auto", "mesh.dp=auto", f"mesh.chip={chip}", f"device={device}")
    m = MESH_LINE.fullmatch(lines[0])
    assert (int(m.group(2)), int(m.group(1))) == (tp, dp), lines
    assert any(f"tp=auto chose {tp}: the smallest tp" in ln for ln in lines)
    assert any(f"dp=auto chose {dp}: 8 chips per host / tp {tp}" in ln for ln in lines)
    # The rule by hand: the smallest tp whose per-rank weights + 2 GiB fit in 90% of the chip (the table).
    fitting = [t for t, gib in FLUX2_DEV_RANK_GIB.items() if gib + 2 <= 0.9 * {"v6e": 32, "h200": 141}[chip]]
    assert fitting[0] == tp


# FLUX.2-dev's weights per rank in bf16 (GiB), by hand from its parameter counts: transformer 32,223,281,152 of
# which 31,406,948,352 in sharded layers, text encoder 23,340,272,640 of which 22,900,899,840, VAE 84,046,372
# (not sharded): (total - sharded + sharded / tp) x 2 bytes, summed.
FLUX2_DEV_RANK_GIB = {1: 103.65, 2: 53.07, 4: 27.78, 8: 15.14}


def test_flux2_dev_weights_per_rank_at_each_tp():
    from launcher.config import load_config
    from launcher.sizing.mesh_plan import rank_bytes

    cfg = load_config("flux2_tp")
    for tp, gib in FLUX2_DEV_RANK_GIB.items():
        assert round(sum(rank_bytes(cfg, PUBLISHED[cfg.model.path], tp).values()) / memory.GIB, 2) == gib, tp


def test_a_mesh_that_does_not_fit_is_refused_by_the_run_and_its_dry_run_alike(tmp_path):
    out = f"output.dir={tmp_path / 'out'}"
    res = launch("--dry-run", "conf=flux2_tp", PROMPTS, "mesh.tp=2", "mesh.dp=4", out)
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: mesh dp=4 tp=2 does not fit:") and "transformer 30.8" in last
    assert "28.8 GiB usable per v6e chip" in last and "use mesh.tp=8" in last and not res.stdout
    # The real run on this CPU host: a named chip of 32 GiB, shared by the 8 processes (cpu's RAM is shared).
    args = ["conf=flux2_tp", PROMPTS, "device=cpu", "mesh.chip=auto", "mesh.chip_memory_gib=32", "mesh.tp=2"]
    real = launch(*args, "mesh.dp=4", out)
    dry = launch("--dry-run", *args, "mesh.dp=4", out)
    assert real.returncode == dry.returncode == 2, real.stderr
    assert real.stderr.strip().splitlines()[-1] == dry.stderr.strip().splitlines()[-1]
    assert "does not fit" in real.stderr.strip().splitlines()[-1]
    assert "Traceback" not in real.stderr + res.stderr and not (tmp_path / "out").exists()


def test_every_real_conf_names_its_chip_and_fits_it(launcher_main, capsys):
    from launcher.config import available_confs, load_config
    from launcher.sizing.mesh_plan import CHIP_DEVICE

    for conf in (c for c in available_confs() if not c.startswith("tiny")):  # the tiny jobs run on this host
        cfg = load_config(conf, [PROMPTS])
        device = CHIP_DEVICE.get(cfg.mesh.chip)
        assert device and cfg.device in ("auto", device), (conf, cfg.mesh.chip, cfg.device)
        assert launcher_main(["--dry-run", f"conf={conf}", PROMPTS, f"device={device}"]) == 0, capsys.readouterr()
        out = capsys.readouterr().out
        assert f"# device: {device} (device={device}), chip: {cfg.mesh.chip}\n" in out, out
        line = next(ln for ln in out.splitlines() if ln.startswith("# mesh: dp="))
        assert MESH_LINE.fullmatch(line) and f"({cfg.mesh.chip}, " in line, line


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["conf=flux2_tp", "mesh.chip=h200"], "mesh.chip=h200 is a cuda chip but device=tpu; set device=cuda"),
        (["mesh.chip=v6e"], "mesh.chip=v6e is a tpu chip but device=cpu; set device=tpu"),
        (["device=auto", "mesh.chip=h200"], "mesh.chip=h200 is a cuda chip but device=auto found cpu on this host"),
        (["conf=sd35_medium"], "mesh.chip=v6e is a tpu chip but device=auto found cpu on this host"),
    ],
)
def test_a_chip_that_contradicts_the_device_is_one_line(args, says, launcher_main, capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("device=auto finds CUDA here")
    for dry in ([], ["--dry-run"]):
        assert launcher_main([*dry, *args, PROMPTS, f"output.dir={tmp_path / 'out'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {says}"), err
    assert not (tmp_path / "out").exists()
