"""Neuron path, `envcheck`: findings on the fake runtime, the exit code, the real host's
report, and libfabric's unresolved names.

Against a FAKE libnrt (tests/fakes/fake_libnrt.c) and CPU stand-in tensors; the fake is as
strict as the real runtime where it matters (tests/helpers_neuron.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import helpers_neuron
import pytest

from kvferry.neuron import envcheck, envcheck_libfabric, libnrt
from kvferry.neuron.findings import MISSING, OK, WARN, Finding

fake_lib = helpers_neuron.fake_lib
runtime = helpers_neuron.runtime
nrt = helpers_neuron.nrt
private = helpers_neuron.private


# -- envcheck ------------------------------------------------------------------------------
def test_envcheck_findings(nrt: libnrt.Libnrt, tmp_path: Path) -> None:
    f = envcheck.check_libnrt()
    assert f.status == OK and "64 NeuronCores" in f.detail  # asked before/without init
    f = envcheck.check_libfabric("/nonexistent/libfabric.so.1")
    assert f.blocking and "unusable" in f.detail and "EFA installer" in f.fix
    bad = envcheck.check_shm(True, {})
    assert bad.blocking and "FI_EFA_ENABLE_SHM_TRANSFER=0" in bad.fix
    assert envcheck.check_shm(True, {"FI_EFA_ENABLE_SHM_TRANSFER": "0"}).status == OK
    assert envcheck.check_shm(False, {}).status == OK
    assert "FI_EFA_USE_DEVICE_RDMA=1" in envcheck.check_hmem({}).fix
    assert envcheck.check_map_hbm({"NEURON_RT_MAP_HBM": "1"}).status == OK
    assert envcheck.check_map_hbm({}).status == WARN
    sysfs = tmp_path / "ib"
    (sysfs / "rdmap16s27" / "device").mkdir(parents=True)
    (tmp_path / "drivers" / "efa").mkdir(parents=True)
    os.symlink(tmp_path / "drivers" / "efa", sysfs / "rdmap16s27" / "device" / "driver")
    ok = envcheck.check_efa_devices(str(sysfs))
    assert ok.status == OK and "rdmap16s27" in ok.detail
    (tmp_path / "empty").mkdir()
    if not shutil.which("fi_info"):
        assert envcheck.check_efa_devices(str(tmp_path / "empty")).blocking


def test_envcheck_main_exit_code(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(envcheck, "run_checks", lambda *a, **k: [
        Finding("libfabric", MISSING, "1.17 < 1.21", "install EFA", True)])
    assert envcheck.main([]) == 1
    assert "[FAIL] libfabric" in capsys.readouterr().out
    monkeypatch.setattr(envcheck, "run_checks", lambda *a, **k: [
        Finding("libnrt", OK, "loaded")])
    assert envcheck.main(["--json"]) == 0


def test_real_host_report_runs(nrt: libnrt.Libnrt) -> None:
    """The full report on this machine: every check answers, nothing raises."""
    findings = envcheck.run_checks(colocated=True, env={"FI_EFA_USE_DEVICE_RDMA": "1"})
    names = [f.check for f in findings]
    assert names[0] == "libnrt" and "libfabric" in names and "efa-shm" in names
    assert "map-hbm" in names and "init-order" not in names
    assert all(f.status in (OK, MISSING, WARN) for f in findings)


def test_unresolved_names_missing_libraries_and_symbol_versions() -> None:
    """Measured here: NIXL 1.5.1's plugin with libfabric 2.1.0 (Debian's newest, built from
    source) loads the library but lacks the FABRIC_1.10 fi_getinfo ABI; the check says so."""
    ldd = ("/x/libplugin_LIBFABRIC.so: /opt/lf/lib/libfabric.so.1: version `FABRIC_1.10' not "
           "found (required by /x/libplugin_LIBFABRIC.so)\n"
           "\tlinux-vdso.so.1 (0x00007ffd)\n"
           "\tlibfabric.so.1 => /opt/lf/lib/libfabric.so.1 (0x00007f)\n"
           "\tlibcuda.so.1 => not found\n")
    assert envcheck_libfabric.unresolved(ldd) == ["FABRIC_1.10 (not in libfabric.so.1)", "libcuda.so.1"]
    assert envcheck_libfabric.unresolved("\tlibc.so.6 => /lib/libc.so.6 (0x1)\n") == []
