"""deploy/meshgen-nightly.{service,timer}: systemd itself checks the units (with this checkout in /opt/meshgen's
place), and they say what the README promises: the same command each night, exit 4 (last night's run still holds
the lock) is no failure, a stop is a SIGTERM to the launcher alone."""

import configparser
import getpass
import shutil
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string((DEPLOY / name).read_text())
    return parser


def test_systemd_accepts_the_units(tmp_path):
    if not shutil.which("systemd-analyze"):
        pytest.skip("NOT TESTED: systemd-analyze is not installed (apt-get install systemd)")
    repo = DEPLOY.parent
    service = (DEPLOY / "meshgen-nightly.service").read_text()
    service = service.replace("/opt/meshgen", str(repo)).replace("User=meshgen", f"User={getpass.getuser()}")
    (tmp_path / "meshgen-nightly.service").write_text(service)
    shutil.copy(DEPLOY / "meshgen-nightly.timer", tmp_path)
    res = subprocess.run(
        [
            "systemd-analyze",
            "verify",
            str(tmp_path / "meshgen-nightly.service"),
            str(tmp_path / "meshgen-nightly.timer"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "Unknown" not in res.stderr and "ignoring" not in res.stderr, res.stderr
    cal = subprocess.run(["systemd-analyze", "calendar", _unit("meshgen-nightly.timer")["Timer"]["OnCalendar"]])
    assert cal.returncode == 0


def test_the_service_runs_launch_sh_and_takes_exit_4_as_success():
    service = _unit("meshgen-nightly.service")["Service"]
    exec_start = service["ExecStart"].split()
    assert exec_start[0] == f"{service['WorkingDirectory']}/launch.sh"
    assert "4" in service["SuccessExitStatus"].split()
    assert service["KillMode"] == "mixed"  # SIGTERM to the launcher, which stops its workers itself
    timer = _unit("meshgen-nightly.timer")
    assert timer["Install"]["WantedBy"] == "timers.target"
    assert "Unit" not in timer["Timer"]  # the timer starts the service of its own name
