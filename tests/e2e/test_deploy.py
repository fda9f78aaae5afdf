"""deploy/semantic.service: a unit systemd accepts, running `semantic serve` on its own home, hardened."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

UNIT = ROOT / "deploy" / "semantic.service"


def test_the_unit_runs_semantic_serve_restarts_on_failure_and_is_hardened() -> None:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    unit.read_string(UNIT.read_text())
    service = unit["Service"]
    program, *args = service["ExecStart"].split()
    assert (Path(program).is_absolute(), Path(program).name, args) == (True, "semantic", ["serve"])
    assert service["Environment"] == f"SEMANTIC_HOME=/var/lib/{service['StateDirectory']}"
    assert service["Restart"] == "on-failure"
    hardening = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
                 "DynamicUser": "yes", "UMask": "0077"}
    assert {key: service.get(key) for key in hardening} == hardening
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    """Run where systemd-analyze is installed; with ExecStart pointed at this environment's
    `semantic` (verify checks the binary exists)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (the unit's keys are checked above)")
    semantic = Path(sys.executable).parent / "semantic"
    assert semantic.exists()
    unit = tmp_path / "semantic.service"
    unit.write_text(UNIT.read_text().replace("/opt/semantic/bin/semantic", str(semantic)))
    done = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # verify exits 0 on unknown keys and bad values too, only warning: any output is a finding.
    assert (done.returncode, done.stdout + done.stderr) == (0, "")
