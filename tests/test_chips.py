"""`mesh.chip=auto` detection, `mesh.chip_memory_gib` and `mesh.chips_per_host`, with known answers: the TPU
VM's accelerator type, nvidia-smi's answer (a stand-in script on PATH), the host's RAM on CPU."""

import os

import pytest

from launcher.config import load_config
from launcher.errors import ConfigError
from launcher.sizing.mesh_plan import detect_chip


def _cfg(*overrides: str):
    return load_config("tiny", list(overrides))


@pytest.mark.parametrize(
    ("accelerator", "name", "gib"),
    [("v6e-8", "v6e", 32.0), ("v5litepod-4", "v5e", 16.0), ("tpu7x-8", "v7x", 192.0), ("v5p-16", "v5p", 95.0)],
)
def test_auto_reads_the_tpu_vms_accelerator_type(monkeypatch, accelerator, name, gib):
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", accelerator)
    chip = detect_chip(_cfg("mesh.chips_per_host=8"), "tpu")
    assert (chip.name, chip.memory_gib, chip.per_host) == (name, gib, 8)


def _fake_nvidia_smi(monkeypatch, tmp_path, answer: str) -> None:
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(f"#!/bin/sh\necho '{answer}'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")


def test_auto_asks_nvidia_smi_and_prefers_the_table(monkeypatch, tmp_path):
    _fake_nvidia_smi(monkeypatch, tmp_path, "NVIDIA H200, 143771")
    chip = detect_chip(_cfg("mesh.chips_per_host=8"), "cuda")
    assert (chip.name, chip.memory_gib, chip.per_host) == ("h200", 141.0, 8)


def test_an_unknown_gpu_gets_the_memory_nvidia_smi_reports(monkeypatch, tmp_path):
    _fake_nvidia_smi(monkeypatch, tmp_path, "NVIDIA L4, 23034")
    chip = detect_chip(_cfg("mesh.chips_per_host=1"), "cuda")
    assert (chip.name, chip.memory_gib) == ("NVIDIA L4", 23034 / 1024)


def test_chip_memory_gib_overrides_the_table_and_chips_per_host_is_taken_as_given():
    chip = detect_chip(_cfg("mesh.chip=v6e", "mesh.chip_memory_gib=20", "mesh.chips_per_host=4"), "tpu")
    assert (chip.name, chip.memory_gib, chip.per_host) == ("v6e", 20.0, 4)


def test_cpu_is_the_hosts_ram():
    chip = detect_chip(_cfg(), "cpu")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert chip.name == "cpu" and chip.memory_gib == pytest.approx(ram, abs=0.05) and chip.per_host == 1


def test_an_unknown_named_chip_needs_its_memory():
    with pytest.raises(ConfigError, match="mesh.chip=tpu9 has no known memory.*set mesh.chip_memory_gib"):
        detect_chip(_cfg("mesh.chip=tpu9", "mesh.chips_per_host=4"), "tpu")
    assert (
        detect_chip(_cfg("mesh.chip=tpu9", "mesh.chip_memory_gib=64", "mesh.chips_per_host=4"), "tpu").memory_gib == 64
    )


def test_dp_auto_fills_the_chips_per_host_given():
    from conftest import PROMPTS, launch

    res = launch("--dry-run", "conf=flux2_tp", PROMPTS, "mesh.dp=auto", "mesh.tp=8", "mesh.chips_per_host=16")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "dp=auto chose 2: 16 chips per host / tp 8" in res.stdout
    res = launch("--dry-run", "conf=flux2_tp", PROMPTS, "mesh.tp=8", "mesh.chip_memory_gib=16")
    assert res.returncode == 2 and "16" in res.stderr and "GiB" in res.stderr, res.stderr  # as the real run would
