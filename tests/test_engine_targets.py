"""One engine builder for every target (issue 16/19): `kvferry up`, `kvferry launch`'s ssh
plans and its Kubernetes containers print engines.engine_argv / engine_env of their spec,
and for the same settings those specs differ only in engines.TARGET_FIELDS (interpreter,
listen address, advertised side-channel host, model probing, the instance type's fabric
env) and, for a pod of its own, placement. No secret reaches an argv or a ConfigMap."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvferry.scripts import cli
from kvferry.scripts.engines import TARGET_FIELDS, EngineSpec, engine_argv, engine_env
from kvferry.scripts.instances import P5EN_UCX_TLS
from kvferry.scripts.k8s import render_all, role_plans
from kvferry.scripts.k8s_settings import K8sSettings
from kvferry.scripts.plan import plan
from kvferry.scripts.up_stack import up_engines

SECRET = "targets-test-secret-0123456789ab"
PLACEMENT = ("port", "side_channel_port", "devices")  # a pod has its node to itself
# Same settings for every target: instance type -> (`up` flags, TP, launch NIXL backends)
CASES = {
    "trn2.48xlarge": (["--hardware-backend", "neuron"], 8, None),
    "p5en.48xlarge": (["--hardware-backend", "cuda", "--nixl-backend", "UCX",
                       "--ucx-tls", P5EN_UCX_TLS], 4, ["UCX"]),
}


def split_command(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """`[env] K=V ... argv...` -> (env, argv)."""
    words = words[1:] if words[0] == "env" else words
    n = next(i for i, w in enumerate(words) if not re.match(r"[A-Z_][A-Z0-9_]*=", w))
    return dict(w.split("=", 1) for w in words[:n]), words[n:]


def up_dry_run(args: list[str]) -> dict[str, tuple[dict[str, str], list[str]]]:
    """`kvferry up --dry-run`'s printed processes: name -> (env, argv)."""
    r = CliRunner().invoke(cli.app, ["up", "--dry-run", *args])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    return {m.group(1): split_command(shlex.split(lines[i + 1]))
            for i, line in enumerate(lines) if (m := re.match(r"# (\w+) \(log", line))}


def container_command(c: dict) -> tuple[dict[str, str], list[str]]:
    """A k8s engine container's plain env and argv (after trn2's host prelude)."""
    cmd = c["command"]
    if cmd[:2] == ["/bin/bash", "-c"]:
        cmd = shlex.split(cmd[2].rsplit("\nexec ", 1)[1])
    return {v["name"]: v["value"] for v in c["env"] if "value" in v}, cmd


def differing(a: list[str], b: list[str]) -> list[tuple[str, str]]:
    assert len(a) == len(b), (a, b)
    return [(x, y) for x, y in zip(a, b, strict=True) if x != y]


def kv(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def target_fields(spec: EngineSpec, *extra: str) -> dict:
    return {f: getattr(spec, f) for f in (*TARGET_FIELDS, *extra)}


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A local model dir with weights (so `up` adds no --load-format), cwd for `up`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVFERRY_SECRET", SECRET)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    return str((tmp_path / "m").resolve())


@pytest.mark.parametrize("instance_type", CASES)
def test_up_ssh_and_k8s_run_the_same_engines(instance_type: str, model: str) -> None:
    flags, tp, nixl = CASES[instance_type]
    printed = up_dry_run(["--model", model, "--devices-per-engine", str(tp),
                          "--decode-port", "8101", *flags])
    up = up_engines(model, "neuron" if "neuron" in flags else "cuda",
                    {"prefill": 8100, "decode": 8101}, {"prefill": tp, "decode": tp},
                    ucx_tls=P5EN_UCX_TLS if nixl else None, nixl_backends=nixl)
    ssh = {e.role: e for p in plan(["h0"], instance_type, 1, 1, tp, model, max_model_len=4096)
           for e in p.engines}
    s = K8sSettings(instance_type, model, tp=tp, max_model_len=4096)
    pods = role_plans(s)
    files = render_all(s, SECRET)
    containers = {o["metadata"]["name"].removeprefix("kvferry-"):
                  o["spec"]["template"]["spec"]["containers"][0]
                  for m in files for o in m.objects if o["kind"] == "Deployment"}
    for role in ("prefill", "decode"):
        # every target prints the one builder's output for its spec
        up_env, up_argv = printed[role]
        assert up_argv == engine_argv(up[role])
        assert up_env == {**engine_env(up[role]), "KVFERRY_SECRET": SECRET}
        assert split_command(shlex.split(ssh[role].command())) == (
            engine_env(ssh[role].spec), engine_argv(ssh[role].spec))
        assert container_command(containers[role]) == (
            engine_env(pods[role].spec), engine_argv(pods[role].spec))
        # and the specs are `up`'s but for the documented per-target fields (k8s: placement)
        assert dataclasses.replace(up[role], **target_fields(ssh[role].spec)) == ssh[role].spec
        assert dataclasses.replace(up[role], **target_fields(pods[role].spec, *PLACEMENT)) == \
            pods[role].spec
        # concretely: interpreter, listen address and the side-channel host, nothing else
        ssh_env, ssh_argv = split_command(shlex.split(ssh[role].command()))
        diff = differing(up_argv, ssh_argv)
        assert diff[:2] == [(sys.executable, "python"), ("127.0.0.1", "0.0.0.0")]
        assert kv(ssh_argv) == {**kv(up_argv), "kv_connector_extra_config": {
            **kv(up_argv)["kv_connector_extra_config"], "side_channel_host": "h0"}}
        assert len(diff) == 3  # the third: the --kv-transfer-config JSON just compared
        # the environment: `up`'s, plus the instance type's EFA/UCX/LNC variables
        assert ssh_env == {**engine_env(up[role]), **ssh[role].spec.env}
        assert set(ssh[role].spec.env) <= {"FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA",
                                           "FI_EFA_USE_HUGE_PAGE",
                                           "FI_EFA_ENABLE_SHM_TRANSFER", "UCX_NET_DEVICES",
                                           "NEURON_LOGICAL_NC_CONFIG"}
    # prefill: a pod and `up`'s P own devices 0..TP-1 and the first ports alike
    k8s_env, k8s_argv = container_command(containers["prefill"])
    up_env, up_argv = printed["prefill"]
    assert differing(up_argv, k8s_argv)[:2] == [(sys.executable, "python"),
                                                ("127.0.0.1", "0.0.0.0")]
    assert kv(k8s_argv)["kv_connector_extra_config"] == {
        **kv(up_argv)["kv_connector_extra_config"], "side_channel_host": "$(POD_IP)"}
    assert k8s_env == {**engine_env(up["prefill"]), **pods["prefill"].spec.env}


@pytest.mark.parametrize("instance_type", CASES)
def test_no_secret_in_any_argv_or_configmap(instance_type: str, model: str) -> None:
    flags, tp, _ = CASES[instance_type]
    printed = up_dry_run(["--model", model, "--devices-per-engine", str(tp), *flags])
    assert set(printed) == {"prefill", "decode", "router"}
    for name, (env, argv) in printed.items():
        assert env["KVFERRY_SECRET"] == SECRET, name  # each process's environment
        assert SECRET not in " ".join(argv), name
    plans = plan(["h0", "h1"], instance_type, 1, 1, tp, model)
    for p in plans:
        assert all(SECRET not in c for c in p.commands())
        assert f"export KVFERRY_SECRET={SECRET}\n" in p.script(SECRET)  # the script, once
        assert p.script(SECRET).count(SECRET) == 1
    files = render_all(K8sSettings(instance_type, model, tp=tp), SECRET)
    objs = [o for m in files for o in m.objects]
    assert not [o for o in objs if o["kind"] == "ConfigMap"]
    assert [o["kind"] for o in objs if SECRET in json.dumps(o)] == ["Secret"]
    kvferry_pods = [o for o in objs if o["kind"] == "Deployment"
                    and o["metadata"]["name"] != "kvferry-redis"]
    assert len(kvferry_pods) == 3  # prefill, decode, router
    for o in kvferry_pods:
        for c in o["spec"]["template"]["spec"]["containers"]:
            assert "args" not in c and SECRET not in " ".join(c["command"])
            ref = next(v for v in c["env"] if v["name"] == "KVFERRY_SECRET")
            assert ref == {"name": "KVFERRY_SECRET", "valueFrom": {"secretKeyRef": {
                "name": "kvferry-secret", "key": "KVFERRY_SECRET"}}}
