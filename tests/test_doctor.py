"""`python -m tplab doctor`: the real command on this machine, and its verdicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import report

from tplab.checks import doctor


@pytest.mark.slow
def test_doctor_json_on_this_machine():
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "tplab", "doctor", "--json"],
                         capture_output=True, text=True, timeout=120, env=os.environ)
    seconds = time.perf_counter() - started
    report.LINES["doctor"] = [f"doctor (python -m tplab doctor --json): {seconds:.1f} s"]
    info = json.loads(out.stdout)
    assert out.returncode == (0 if info["ready"] else 1), out.stderr
    assert info["ready"], [c for c in info["checks"] if not c["ok"]]
    names = [c["name"] for c in info["checks"]]
    for name in ("backend", "jupyterlab_renderers", "launch", "all_reduce", "megatron_step",
                 "grad_check"):
        assert name in names
    assert info["versions"]["torch"] and info["machine"]["cores"] >= 1
    assert info["backend"] == "gloo"  # no GPU here
    assert info["largest_world_size"] >= 2


def test_render_says_what_to_fix():
    info = {"versions": {"python": "3.11"}, "machine": {
        "os": "Linux", "cores": 2, "memory_gib": 4, "available_gib": 0.1, "gpus": []},
        "largest_world_size": 0, "suggested_world_size": 1, "ready": False, "seconds": 1.0,
        "checks": [{"name": "launch", "ok": False, "detail": "RuntimeError: boom",
                    "fix": "do this"}]}
    text = doctor.render(info)
    assert "[FAIL] launch: RuntimeError: boom" in text and "fix: do this" in text
    assert "NOT READY" in text


def test_largest_world_size():
    mib = 2**20
    assert doctor.largest_world_size(10 * 1024 * mib, 300 * mib) == 16
    assert doctor.largest_world_size(1024 * mib, 300 * mib) == 2
    assert doctor.largest_world_size(100 * mib, 300 * mib) == 0


def test_missing_renderer_is_a_failure(monkeypatch, tmp_path):
    monkeypatch.setattr(doctor, "jupyter_path", lambda *a: [str(tmp_path)])
    check = doctor.renderers()
    assert not check.ok and "jupyterlab-plotly" in check.detail and "pip install" in check.fix


def test_no_smoke_exits_by_verdict(monkeypatch, capsys):
    assert doctor.main(["--no-smoke"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(doctor, "renderers", lambda: doctor.Check("r", False, "gone", "fix"))
    assert doctor.main(["--no-smoke", "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert not info["ready"]
    assert {"name": "r", "ok": False, "detail": "gone", "fix": "fix"} in info["checks"]
