"""`memfit calibrate --device cuda` and the GPU validation's part i run the accelerator's
calibration ([Note: Calibrating an accelerator]), not the CPU's: the routing, checked on this
CPU host with the device's measurement replaced (it needs a GPU; see docs/devices.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import memfit._plan._calibrate_device as calibrate_device_module
from memfit._plan._calibrate_device import write_profile
from memfit._plan._time import PROFILES
from memfit.cli._config import CalibrateConfig
from memfit.cli._plan import calibrate_command


def _fake_device(calls: list):
    def fake(device="cuda", results: Path | None = None):
        calls.append((str(device), results))
        profile = PROFILES["h100"]
        return profile, write_profile(profile, "h100", results)

    return fake


def test_memfit_calibrate_on_cuda_runs_the_accelerator_calibration(monkeypatch, tmp_path, capsys):
    calls: list = []
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate_device_module, "calibrate_device", _fake_device(calls))
    calibrate_command(CalibrateConfig(device="cuda"))
    assert calls == [("cuda", tmp_path)]  # the named profile's file beside the cache, not in site-packages
    assert json.loads((tmp_path / "device-cuda.json").read_text())["name"] == "h100"
    assert (tmp_path / "profile_h100.json").exists()
    assert "profile_h100.json" in capsys.readouterr().out


def test_part_i_on_cuda_writes_the_named_profile_file(monkeypatch, tmp_path):
    from benchmarks.gpu import calibrate as part_i

    calls: list = []
    monkeypatch.setattr(calibrate_device_module, "calibrate_device", _fake_device(calls))

    class Env:  # what part i reads of benchmarks.gpu._env.Env
        device = "cuda"
        cuda, smoke, out = True, False, tmp_path

    monkeypatch.setattr(part_i, "default_profile", lambda device: PROFILES["h100"])
    monkeypatch.setattr(part_i, "device_name", lambda device: "h100")
    result = part_i.run(Env())  # type: ignore[arg-type]
    assert calls == [("cuda", tmp_path)]
    assert result["figures"]["profile_file"] == str(tmp_path / "profile_h100.json")
    assert any("profile_h100.json" in line for line in result["markdown"])


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
