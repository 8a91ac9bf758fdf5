"""Launch plans for trn2.48xlarge and p5en.48xlarge: placement, ports, env, commands."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import typer
from fakes.vllm_neuron_env import VISIBLE_CORES_REFUSED, ccom_root, visible_devices
from typer.testing import CliRunner

from kvferry.scripts.instances import INSTANCES
from kvferry.scripts.launch import launch_app, read_hosts
from kvferry.scripts.neuron_env import AWS_SAMPLE_ENV, NEURON_ENV_VS_AWS_SAMPLE, neuron_prelude
from kvferry.scripts.plan import PlanError, plan


def engines(plans):
    return [e for p in plans for e in p.engines]


def kv_config(e) -> dict:
    argv = e.argv
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def check_invariants(plans, units: int) -> None:
    for p in plans:
        devs = [d for e in p.engines for d in e.devices]
        assert len(devs) == len(set(devs)), f"overlap on {p.host}"
        assert all(0 <= d < units for d in devs)
        ports = [e.http_port for e in p.engines]
        ports += [q for e in p.engines for q in range(e.side_channel_port,
                                                      e.side_channel_port + len(e.devices))]
        if p.router:
            ports.append(int(p.router[p.router.index("--port") + 1]))
        assert len(ports) == len(set(ports)), f"port clash on {p.host}"
        for e in p.engines:
            assert e.devices == tuple(range(e.devices[0], e.devices[0] + len(e.devices)))
            assert e.devices[0] % len(e.devices) == 0  # TP-aligned
            cfg = kv_config(e)
            assert cfg["kv_connector"] == "KvferryConnector"
            assert cfg["kv_connector_module_path"] == "kvferry.connectors.connector"
            assert cfg["kv_role"] == "kv_both" and cfg["kv_load_failure_policy"] == "recompute"
            extra = cfg["kv_connector_extra_config"]
            assert extra["side_channel_host"] == p.host
            assert extra["side_channel_port"] == e.side_channel_port
            assert e.argv[e.argv.index("--tensor-parallel-size") + 1] == str(len(e.devices))


def test_trn2_2p2d_tp16_one_host_shared() -> None:
    plans = plan(["trn-a"], "trn2.48xlarge", 2, 2, 16, "meta-llama/Llama-3.1-8B")
    check_invariants(plans, 64)
    es = engines(plans)
    assert [e.env["NEURON_VISIBLE_DEVICES"] for e in es] == ["0-15", "16-31", "32-47", "48-63"]
    assert [e.env["NEURON_RT_ROOT_COMM_ID"] for e in es] == [
        "localhost:61234", "localhost:61250", "localhost:61266", "localhost:61282"]
    for e in es:
        assert "NEURON_RT_VISIBLE_CORES" not in e.env  # vllm-neuron's workers refuse it
        assert e.env["FI_PROVIDER"] == "efa" and e.env["FI_EFA_USE_DEVICE_RDMA"] == "1"
        assert e.env["FI_EFA_ENABLE_SHM_TRANSFER"] == "0"
        assert e.env["NEURON_LOGICAL_NC_CONFIG"] == "2" and e.env["NEURON_RT_MAP_HBM"] == "1"
        assert e.env["CUDA_VISIBLE_DEVICES"] == ""
        extra = kv_config(e)["kv_connector_extra_config"]
        # no NIXL backend forced: the memory backend's registration fallback picks them
        assert extra["hardware_backend"] == "neuron" and "nixl_backends" not in extra
        assert e.argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
        assert "--block-size" in e.argv
    assert [e.role for e in es] == ["prefill", "prefill", "decode", "decode"]


def test_trn2_multi_host_separate_roles_and_lnc1() -> None:
    hosts = ["t0", "t1", "t2"]
    plans = plan(hosts, "trn2.48xlarge", 3, 1, 32, "m", separate_roles=True)
    check_invariants(plans, 64)
    by_host = {p.host: [e.role for e in p.engines] for p in plans}
    assert by_host == {"t0": ["prefill", "prefill"], "t1": ["prefill"], "t2": ["decode"]}
    assert all(e.env["FI_EFA_ENABLE_SHM_TRANSFER"] == "0" for e in engines(plans))
    router = plans[0].router
    assert router[:2] == ["kvferry", "router"]
    assert router[router.index("--prefill") + 1].split(",") == \
        ["http://t0:8100", "http://t0:8101", "http://t1:8100"]
    assert router[router.index("--decode") + 1] == "http://t2:8100"
    # push needs P's side channels; conversation reuse D's lease-control ports (after
    # each engine's TP-rank side-channel ports).
    tp_ranks = len(engines(plans)[0].devices)
    assert router[router.index("--prefill-kv") + 1].split(",") == \
        ["t0:5600", f"t0:{5600 + tp_ranks + 1}", "t1:5600"]
    assert router[router.index("--decode-control") + 1] == f"t2:{5600 + tp_ranks}"
    # LNC=1 exposes all 128 physical cores
    plans = plan(["t0"], "trn2.48xlarge", 1, 1, 64, "m", lnc=1)
    check_invariants(plans, 128)
    assert [e.env["NEURON_VISIBLE_DEVICES"] for e in engines(plans)] == ["0-63", "64-127"]


def test_p5en_gpus_ucx_and_libfabric() -> None:
    plans = plan(["g0", "g1"], "p5en.48xlarge", 2, 3, 4, "Qwen/Qwen3-32B", decode_tp=2)
    check_invariants(plans, 8)
    es = engines(plans)
    assert [e.env["CUDA_VISIBLE_DEVICES"] for e in es] == ["0,1,2,3", "4,5,6,7", "0,1", "2,3", "4,5"]
    assert [e.host for e in es] == ["g0", "g0", "g1", "g1", "g1"]
    for e in es:
        assert e.env["UCX_TLS"] == "srd,cuda_copy,cuda_ipc,sm,self"
        assert e.env["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # cross-layer KV blocks
        assert "NEURON_VISIBLE_DEVICES" not in e.env
        extra = kv_config(e)["kv_connector_extra_config"]
        assert extra["hardware_backend"] == "cuda" and extra["nixl_backends"] == ["UCX"]
        assert "--block-size" not in e.argv
    lf = plan(["g0"], "p5en.48xlarge", 1, 1, 4, "m", nixl_backends=["LIBFABRIC"])
    assert all("UCX_TLS" not in e.env for e in engines(lf))
    assert all(e.env["FI_EFA_ENABLE_SHM_TRANSFER"] == "0" for e in engines(lf))


def test_hardware_limits_and_bad_input() -> None:
    with pytest.raises(PlanError, match="exceeds the hardware"):
        plan(["g0"], "p5en.48xlarge", 2, 1, 4, "m")  # 12 GPUs > 8
    with pytest.raises(PlanError, match="exceeds the hardware"):
        plan(["t0", "t1"], "trn2.48xlarge", 2, 2, 64, "m")  # 4 x 64 cores > 2 x 64
    with pytest.raises(PlanError, match="cannot span instances"):
        plan(["t0", "t1"], "trn2.48xlarge", 1, 1, 128, "m")  # LNC=2: 64 per host
    with pytest.raises(PlanError, match="needs hardware backend 'neuron'"):
        plan(["t0"], "trn2.48xlarge", 1, 1, 8, "m", hardware_backend="cuda")
    with pytest.raises(PlanError, match="unknown instance"):
        plan(["t0"], "trn1.32xlarge", 1, 1, 8, "m")
    with pytest.raises(PlanError, match="each once"):
        plan(["t0", "t0"], "trn2.48xlarge", 1, 1, 8, "m")
    with pytest.raises(PlanError, match="port ranges overlap"):
        plan(["t0"], "trn2.48xlarge", 1, 1, 8, "m", http_port=5600, side_channel_port=5600)
    # exactly full is fine: 8 x TP 8 = 64 logical cores
    check_invariants(plan(["t0"], "trn2.48xlarge", 4, 4, 8, "m"), INSTANCES["trn2.48xlarge"].units())


def test_commands_script_and_router_host(tmp_path: Path) -> None:
    plans = plan(["t0", "t1"], "trn2.48xlarge", 1, 1, 64, "m", router_host="edge",
                 neuron_staging="host")
    assert [p.host for p in plans] == ["t0", "t1", "edge"]
    assert plans[2].engines == [] and plans[2].router and plans[0].router is None
    e = plans[0].engines[0]
    assert e.env["KVFERRY_NEURON_STAGING"] == "host"
    assert kv_config(e)["kv_connector_extra_config"]["neuron_staging"] == "host"
    cmd = shlex.split(e.command())
    assert cmd[0] == "env" and "NEURON_VISIBLE_DEVICES=0-63" in cmd
    assert cmd[cmd.index("--kv-transfer-config") + 1] == e.argv[e.argv.index("--kv-transfer-config") + 1]
    script = plans[2].script("s3cr3t")
    assert "export KVFERRY_SECRET=s3cr3t\n" in script
    assert "http://t0:8100" in script and "curl -sf" in script and "kvferry router" in script
    assert plans[0].ssh("/tmp/t0.sh") == "ssh t0 bash -s < /tmp/t0.sh"
    hf = tmp_path / "hosts"
    hf.write_text("# cluster\nt0 slots=1\n\nt1\n")
    assert read_hosts("x,y", hf) == ["x", "y", "t0", "t1"]


def test_cli_dry_run_and_scripts(tmp_path: Path) -> None:
    app = typer.Typer()
    app.add_typer(launch_app, name="launch")

    @app.command()
    def version() -> None:  # a second command so "launch" stays a sub-command
        pass

    r = CliRunner().invoke(app, ["launch", "--model", "m", "-i", "trn2.48xlarge", "--hosts", "t0",
                                 "--prefill", "1", "--decode", "1", "--tp", "32", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "NEURON_VISIBLE_DEVICES=32-63" in r.output and "kvferry router" in r.output
    assert "NEURON_RT_VISIBLE_CORES" not in r.output
    assert "/opt/amazon/efa/lib" in r.output  # the host prelude is printed too
    assert re.search(r"^export KVFERRY_SECRET=[0-9a-f]{32}$", r.output, re.M)
    assert not (tmp_path / "out").exists()
    r = CliRunner().invoke(app, ["launch", "--model", "m", "-i", "p5en.48xlarge", "--hosts", "g0",
                                 "--tp", "8", "--out-dir", str(tmp_path / "out")])
    assert r.exit_code == 2 and "exceeds the hardware" in r.output
    r = CliRunner().invoke(app, ["launch", "--model", "m", "-i", "p5en.48xlarge", "--hosts", "g0",
                                 "--tp", "4", "--out-dir", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    script = tmp_path / "out" / "g0.sh"
    assert script.read_text().startswith("#!/usr/bin/env bash")
    # Every host's script exports the same secret, readable by its owner only.
    assert re.search(r"^export KVFERRY_SECRET=[0-9a-f]{32}$", script.read_text(), re.M)
    assert script.stat().st_mode & 0o777 == 0o700
    assert "ssh g0 bash -s <" in r.output


def test_every_host_script_carries_the_one_secret(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """P signs offers, D verifies them, the router signs lease requests: without one
    shared KVFERRY_SECRET every pull would recompute; the user's own value wins."""
    app = typer.Typer()
    app.add_typer(launch_app, name="launch")

    @app.command()
    def version() -> None:
        pass

    monkeypatch.setenv("KVFERRY_SECRET", "team-secret-1")
    r = CliRunner().invoke(app, ["launch", "--model", "m", "-i", "trn2.48xlarge",
                                 "--hosts", "t0,t1", "--tp", "64", "--separate-roles",
                                 "--out-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    scripts = sorted(tmp_path.glob("*.sh"))
    assert [p.name for p in scripts] == ["t0.sh", "t1.sh"]
    for p in scripts:
        assert "export KVFERRY_SECRET=team-secret-1\n" in p.read_text()
    assert "team-secret-1" not in r.output  # written to the scripts, not echoed
    with pytest.raises(PlanError):
        plan(["t0"], "trn2.48xlarge", 1, 1, 32, "m")[0].script("")


# -- trn2 plans against vllm-neuron and AWS's sample ------------------------------------------
TRN2_PLANS = [
    dict(hosts=["t0"], prefill=2, decode=2, tp=16),
    dict(hosts=["t0"], prefill=4, decode=4, tp=8),
    dict(hosts=["t0", "t1"], prefill=3, decode=2, tp=8, decode_tp=32),
    dict(hosts=["t0"], prefill=1, decode=1, tp=64, lnc=1),
]


@pytest.mark.parametrize("kw", TRN2_PLANS)
def test_trn2_engines_pass_vllm_neurons_worker_checks(kw) -> None:
    """Point 1: every engine of a trn2 plan starts under vllm-neuron's multiprocess worker
    (FAKE of NeuronWorker._get_visible_devices: NEURON_VISIBLE_DEVICES, one core per TP
    rank, NEURON_RT_VISIBLE_CORES refused), and co-located engines get distinct collective
    bootstrap addresses, equal to the ones vllm-neuron derives itself."""
    kw = dict(kw)
    plans = plan(kw.pop("hosts"), "trn2.48xlarge", model="m", **kw)
    for p in plans:
        roots = []
        for e in p.engines:
            assert visible_devices(e.env, len(e.devices)) == list(e.devices)
            assert ccom_root(e.env) == e.env["NEURON_RT_ROOT_COMM_ID"]
            roots.append(e.env["NEURON_RT_ROOT_COMM_ID"])
        assert len(roots) == len(set(roots)), p.host


def test_the_fake_worker_check_refuses_what_vllm_neuron_refuses() -> None:
    with pytest.raises(RuntimeError, match=re.escape(VISIBLE_CORES_REFUSED)):
        visible_devices({"NEURON_RT_VISIBLE_CORES": "0-15"}, 16)
    with pytest.raises(RuntimeError, match="local_world_size=8"):
        visible_devices({"NEURON_VISIBLE_DEVICES": "0-3"}, 8)


def test_trn2_env_is_accounted_for_against_aws_sample() -> None:
    """Every variable a trn2 engine gets, and every one AWS's disagg_serve_vllm sample
    sets, has a one-line decision in neuron_env.py; adopted ones carry the sample's value."""
    env: dict[str, str] = {}
    for kw in TRN2_PLANS:
        kw = dict(kw)
        for e in engines(plan(kw.pop("hosts"), "trn2.48xlarge", model="m",
                              neuron_staging="host", **kw)):
            env.update(e.env)
    assert set(env) | set(AWS_SAMPLE_ENV) <= set(NEURON_ENV_VS_AWS_SAMPLE)
    for var, note in NEURON_ENV_VS_AWS_SAMPLE.items():
        assert re.match(r"(adopted|kept|not adopted)[ :]", note) and len(note) > 30, var
        if note.startswith("adopted:"):
            assert env[var] == AWS_SAMPLE_ENV[var], var
        if note.startswith("not adopted"):
            assert var not in env, var


def test_port_plan_includes_the_neuron_bootstrap_ports() -> None:
    with pytest.raises(PlanError, match="port ranges overlap"):
        plan(["t0"], "trn2.48xlarge", 1, 1, 8, "m", http_port=61242)  # decode's root: 61234+8


@pytest.mark.skipif(shutil.which("cc") is None or shutil.which("ldconfig") is None,
                    reason="needs cc and ldconfig")
def test_neuron_prelude_builds_the_libcuda_stub(tmp_path: Path) -> None:
    """The script prelude runs: EFA's libfabric first on the loader path, and where
    libcuda.so.1 is missing, AWS's no-op stub with the three symbols NIXL's plugin links."""
    script = "\n".join(["set -euo pipefail", *neuron_prelude(), 'echo "$LD_LIBRARY_PATH"'])
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("LD_LIBRARY_PATH", None)
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                         check=True).stdout.strip().split(":")
    assert out[0] == "/opt/amazon/efa/lib"
    stub = tmp_path / ".cache/kvferry/libcuda-stub/libcuda.so.1"
    has_libcuda = "libcuda.so.1 " in subprocess.run(["ldconfig", "-p"], capture_output=True,
                                                    text=True).stdout
    assert stub.exists() is not has_libcuda
    if stub.exists():
        assert out[1] == str(stub.parent)
        syms = subprocess.run(["nm", "-D", str(stub)], capture_output=True, text=True).stdout
        for sym in ("cuCtxSetCurrent", "cuDeviceGetPCIBusId", "cuPointerGetAttributes"):
            assert f" T {sym}" in syms
