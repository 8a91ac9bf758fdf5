"""`kvferry launch --target k8s`: every object valid against the Kubernetes schemas of
K8S_VERSION (kubernetes-validate ships them: offline) and the vendored ServiceMonitor CRD;
`kubectl kustomize` renders the directory; the containers run exactly the ssh plan's
engines; the secret is only in the Secret."""

from __future__ import annotations

import copy
import json
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import typer
import yaml
from typer.testing import CliRunner

from kvferry.scripts.cli import app as kvferry_app
from kvferry.scripts.k8s import render_all, router_argv
from kvferry.scripts.k8s_render import write_dir
from kvferry.scripts.k8s_settings import K8S_VERSION, SOURCES, K8sSettings
from kvferry.scripts.launch import launch_app
from kvferry.scripts.neuron_env import neuron_prelude
from kvferry.scripts.plan import PlanError, plan

SECRET = "k8s-test-secret-0123456789abcdef"
SCHEMAS = Path(__file__).parent / "schemas"
CASES = {
    "trn2-plugin": K8sSettings("trn2.48xlarge", "meta-llama/Llama-3.1-8B", prefill=2, decode=3, tp=8),
    "trn2-dra": K8sSettings("trn2.48xlarge", "m", tp=16, decode_tp=32, neuron_devices="dra",
                            neuron_staging="host", service_monitor=True),
    "trn2-lnc1-whole-node": K8sSettings("trn2.48xlarge", "m", tp=128, lnc=1, neuron_devices="dra"),
    "p5en": K8sSettings("p5en.48xlarge", "Qwen/Qwen3-32B", prefill=1, decode=2, tp=4, decode_tp=2),
    "p5en-external-redis": K8sSettings("p5en.48xlarge", "m", tp=8, router_replicas=3,
                                       redis_url="rediss://:pw@redis.example:6380/1",
                                       service_monitor=True, nixl_backends=["LIBFABRIC"]),
    "p5en-keda": K8sSettings("p5en.48xlarge", "m", tp=8, prefill=2, decode=3, max_decode=9,
                             autoscaler="keda", service_monitor=True, drain_s=120),
    "trn2-fixed": K8sSettings("trn2.48xlarge", "m", tp=8, prefill=2, decode=3, autoscaler="none"),
}


def objects(files) -> list[dict[str, Any]]:
    return [o for m in files if m.filename != "kustomization.yaml" for o in m.objects]


def by_kind(files, kind: str) -> list[dict[str, Any]]:
    return [o for o in objects(files) if o["kind"] == kind]


def deployment(files, component: str) -> dict[str, Any]:
    return next(o for o in by_kind(files, "Deployment")
                if o["metadata"]["name"] == f"kvferry-{component}")


def container(files, component: str) -> dict[str, Any]:
    return deployment(files, component)["spec"]["template"]["spec"]["containers"][0]


def crd_schema(path: Path, version: str) -> dict[str, Any]:
    """The CRD's openAPIV3Schema for `version`, closed like the API server's strict field
    validation (unknown fields are errors, not pruned)."""
    crd = next(d for d in yaml.safe_load_all(path.read_text()) if d)
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]
    schema = copy.deepcopy(schema["openAPIV3Schema"])

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for v in node.values():
                close(v)
        elif isinstance(node, list):
            for v in node:
                close(v)
    close(schema)
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


CRDS = {"monitoring.coreos.com/v1": ("monitoring.coreos.com_servicemonitors.yaml", "v1"),
        "keda.sh/v1alpha1": ("keda.sh_scaledobjects.yaml", "v1alpha1")}


def validate(obj: dict[str, Any]) -> None:
    if obj["apiVersion"] in CRDS:
        path, version = CRDS[obj["apiVersion"]]
        jsonschema.Draft7Validator(crd_schema(SCHEMAS / path, version)).validate(obj)
        return
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("case", CASES)
def test_every_object_validates_against_the_real_schemas(case: str) -> None:
    files = render_all(CASES[case], SECRET)
    kinds = {o["kind"] for o in objects(files)}
    assert {"Deployment", "Service", "Secret", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    for o in objects(files):
        validate(o)
    assert ("ServiceMonitor" in kinds) is CASES[case].service_monitor
    assert ("ResourceClaimTemplate" in kinds) is (CASES[case].neuron_devices == "dra")
    assert ("HorizontalPodAutoscaler" in kinds) is (CASES[case].autoscaler == "hpa")
    assert ("ScaledObject" in kinds) is (CASES[case].autoscaler == "keda")
    # the files parse back to exactly the objects generated
    for m in files:
        assert [d for d in yaml.safe_load_all(m.render()) if d] == m.objects, m.filename


def test_the_validators_catch_mistakes() -> None:
    files = render_all(CASES["trn2-dra"], SECRET)
    dep = copy.deepcopy(deployment(files, "prefill"))
    dep["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(dep)
    sm = copy.deepcopy(by_kind(files, "ServiceMonitor")[0])
    sm["spec"]["endpoints"][0]["intervall"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        validate(sm)
    sm["spec"]["endpoints"][0] = {"port": "http", "interval": "thirty seconds"}
    with pytest.raises(jsonschema.ValidationError):  # the CRD's duration pattern
        validate(sm)


def _ssh_engine(s: K8sSettings, role: str):
    """The ssh plan's engine for the same settings, P and D on their own hosts."""
    plans = plan(["p-host", "d-host"], s.instance_type, 1, 1, s.tp, s.model, decode_tp=s.decode_tp,
                 lnc=s.lnc, nixl_backends=s.nixl_backends, separate_roles=True,
                 neuron_staging=s.neuron_staging)
    e = next(e for p in plans for e in p.engines if e.role == role)
    return e, e.host


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_containers_run_the_ssh_plans_engines(case: str, role: str) -> None:
    """One source: the container command is the ssh plan's argv (its side-channel host
    the pod IP) after the same host prelude; its environment is the plan's."""
    s = CASES[case]
    c = container(render_all(s, SECRET), role)
    e, host = _ssh_engine(s, role)
    argv = [a.replace(f'"side_channel_host":"{host}"', '"side_channel_host":"$(POD_IP)"')
            for a in e.argv]
    if s.instance_type.startswith("trn2"):
        assert c["command"][:2] == ["/bin/bash", "-c"]
        lines = c["command"][2].split("\n")
        assert lines[:-1] == neuron_prelude()
        assert lines[-1] == f"exec {shlex.join(argv)}"
    else:
        assert c["command"] == argv
    assert "args" not in c
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert kv["side_channel_host"] == "$(POD_IP)"
    env = c["env"]
    assert env[0] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    plain = {v["name"]: v["value"] for v in env if "value" in v}
    assert plain == e.env
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == e.http_port
    assert ports["lease-control"] == kv["lease_control_port"]
    assert [ports[f"side-{r}"] for r in range(len(e.devices))] == \
        list(range(kv["side_channel_port"], kv["side_channel_port"] + len(e.devices)))


def test_hardware_settings_per_instance_type() -> None:
    # trn2, device plugin: TP 8 at LNC=2 = 8 logical cores = 2 Neuron devices, 1 EFA each
    files = render_all(CASES["trn2-plugin"], SECRET)
    pod = deployment(files, "prefill")["spec"]["template"]["spec"]
    res = pod["containers"][0]["resources"]
    assert res["limits"] == res["requests"]
    assert res["limits"]["aws.amazon.com/neuron"] == "2"
    assert res["limits"]["vpc.amazonaws.com/efa"] == "2"
    assert pod["containers"][0]["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert {"name": "NEURON_VISIBLE_DEVICES", "value": "0-7"} in pod["containers"][0]["env"]
    assert pod["volumes"][0]["emptyDir"]["medium"] == "Memory"
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "trn2.48xlarge"}
    assert "affinity" not in pod  # trn2 co-locates P and D, as AWS's sample does
    hpas = {o["metadata"]["name"]: o["spec"] for o in by_kind(files, "HorizontalPodAutoscaler")}
    assert hpas["kvferry-prefill"]["minReplicas"] == 2 and hpas["kvferry-decode"]["minReplicas"] == 3
    assert "replicas" not in deployment(files, "prefill")["spec"]  # the HPA owns the count
    fixed = render_all(CASES["trn2-fixed"], SECRET)
    assert deployment(fixed, "prefill")["spec"]["replicas"] == 2
    assert deployment(fixed, "decode")["spec"]["replicas"] == 3
    # trn2, DRA: claims instead of extended resources, one devicegroup8 when it fits
    files = render_all(CASES["trn2-dra"], SECRET)
    rcts = {o["metadata"]["name"]: o for o in by_kind(files, "ResourceClaimTemplate")}
    dev = rcts["kvferry-decode-neuron-efa"]["spec"]["spec"]["devices"]
    assert [r["exactly"]["count"] for r in dev["requests"]] == [8, 8]  # TP 32 at LNC=2
    assert [r["exactly"]["deviceClassName"] for r in dev["requests"]] == \
        ["neuron.aws.com", "efa.networking.k8s.aws"]
    assert dev["constraints"][0]["matchAttribute"] == "resource.aws.com/devicegroup8_id"
    assert dev["config"][0]["opaque"]["parameters"]["logicalNeuronCore"] == 2
    pod = deployment(files, "decode")["spec"]["template"]["spec"]
    assert pod["resourceClaims"] == [{"name": "neurons",
                                      "resourceClaimTemplateName": "kvferry-decode-neuron-efa"}]
    lim = pod["containers"][0]["resources"]["limits"]
    assert "aws.amazon.com/neuron" not in lim and "vpc.amazonaws.com/efa" not in lim
    whole = render_all(CASES["trn2-lnc1-whole-node"], SECRET)
    dev = by_kind(whole, "ResourceClaimTemplate")[0]["spec"]["spec"]["devices"]
    assert dev["requests"][0]["exactly"]["count"] == 16 and "constraints" not in dev
    # p5en: GPUs, 2 EFA per GPU (llm-d), P and D never on one node
    files = render_all(CASES["p5en"], SECRET)
    for role, gpus in (("prefill", 4), ("decode", 2)):
        pod = deployment(files, role)["spec"]["template"]["spec"]
        lim = pod["containers"][0]["resources"]["limits"]
        assert lim["nvidia.com/gpu"] == str(gpus) and lim["vpc.amazonaws.com/efa"] == str(2 * gpus)
        other = "decode" if role == "prefill" else "prefill"
        term = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == other
        assert term["topologyKey"] == "kubernetes.io/hostname"
        env = {v["name"]: v.get("value") for v in pod["containers"][0]["env"]}
        assert env["FI_PROVIDER"] == "efa" and env["UCX_TLS"].startswith("srd")
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, range(gpus)))


@pytest.mark.parametrize("case", CASES)
def test_no_engine_pod_requests_hugepages_and_efa_uses_none(case: str) -> None:
    """EFA on trn2 and p5en needs no huge pages (libfabric-efa): a hugepages request would
    leave pods Pending on nodes that preallocate none, and without one the provider must
    not map any (FI_EFA_USE_HUGE_PAGE=0), on every engine of every target alike."""
    files = render_all(CASES[case], SECRET)
    for role in ("prefill", "decode"):
        c = container(files, role)
        for kind in ("requests", "limits"):
            assert not [r for r in c["resources"].get(kind, {}) if r.startswith("hugepages-")]
        assert {"name": "FI_EFA_USE_HUGE_PAGE", "value": "0"} in c["env"]
        e, _ = _ssh_engine(CASES[case], role)
        assert e.env["FI_EFA_USE_HUGE_PAGE"] == "0"
    dep = next(m for m in files if m.filename == "prefill-deployment.yaml")
    assert "libfabric-efa" in dep.sources


def test_network_policies_say_eks_enforces_them_only_with_the_vpc_cni_agent() -> None:
    files = render_all(CASES["p5en"], SECRET)
    (pol,) = [m for m in files if m.filename == "networkpolicies.yaml"]
    assert "eks-netpol" in pol.sources
    assert f"# follows: {SOURCES['eks-netpol']}" in pol.render()


def test_probes_and_graceful_termination() -> None:
    s = CASES["trn2-plugin"]
    files = render_all(s, SECRET)
    for role in ("prefill", "decode"):
        pod = deployment(files, role)["spec"]["template"]["spec"]
        c = pod["containers"][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["lifecycle"]["preStop"]["sleep"]["seconds"] == s.drain_s
        assert pod["terminationGracePeriodSeconds"] > s.drain_s
    router = deployment(files, "router")
    assert router["spec"]["replicas"] >= 2
    argv = router["spec"]["template"]["spec"]["containers"][0]["command"]
    assert argv[argv.index("--drain-timeout") + 1] == str(s.drain_s)
    assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > s.drain_s


def test_services_and_network_policies() -> None:
    files = render_all(CASES["p5en"], SECRET)
    svcs = {o["metadata"]["name"]: o["spec"] for o in by_kind(files, "Service")}
    assert svcs["kvferry-prefill"]["clusterIP"] == "None"  # one A record per pod
    assert svcs["kvferry-decode"]["clusterIP"] == "None"
    assert not svcs["kvferry-prefill"]["publishNotReadyAddresses"]
    assert all(s.get("type", "ClusterIP") == "ClusterIP" for s in svcs.values())
    pols = {o["metadata"]["name"]: o["spec"] for o in by_kind(files, "NetworkPolicy")}
    eng = pols["kvferry-engines-from-kvferry-only"]
    assert {e["key"]: e["values"] for e in eng["podSelector"]["matchExpressions"]} == {
        "app.kubernetes.io/part-of": ["kvferry"],
        "app.kubernetes.io/component": ["prefill", "decode"]}
    assert eng["ingress"] == [{"from": [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/part-of": "kvferry"}}}]}]
    redis = pols["kvferry-redis-from-router-only"]
    assert redis["ingress"][0]["from"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "router"
    assert pols["kvferry-router-clients"]["ingress"] == [{"ports": [{"port": "http",
                                                                     "protocol": "TCP"}]}]
    ext = render_all(CASES["p5en-external-redis"], SECRET)
    assert not [o for o in objects(ext) if o["metadata"]["name"].startswith("kvferry-redis")]


@pytest.mark.parametrize("case", CASES)
def test_no_secret_outside_the_secret(case: str) -> None:
    s = CASES[case]
    files = render_all(s, SECRET)
    for m in files:
        text = m.render()
        if m.filename == "secret.yaml":
            assert SECRET in text
            continue
        assert SECRET not in text, m.filename
        if s.redis_url:
            assert s.redis_url not in text, m.filename  # may carry a password
    assert not by_kind(files, "ConfigMap")
    for o in by_kind(files, "Deployment"):
        for c in o["spec"]["template"]["spec"]["containers"]:
            for v in c.get("env", []):
                if v["name"] in ("KVFERRY_SECRET", "KVFERRY_STATE_URL"):
                    assert set(v) == {"name", "valueFrom"}
                    assert v["valueFrom"]["secretKeyRef"]["name"] == "kvferry-secret"


def test_router_flags_exist() -> None:
    """The router's command line uses only `kvferry router`'s real flags (DNS discovery of
    the headless Services), and the state URL reaches it from the Secret as env."""
    cmd = typer.main.get_command(kvferry_app)
    real = {o for p in cmd.commands["router"].params for o in p.opts}  # type: ignore[attr-defined]
    argv = router_argv(CASES["p5en"], {"prefill": _ssh_engine(CASES["p5en"], "prefill")[0],
                                       "decode": _ssh_engine(CASES["p5en"], "decode")[0]})
    used = {a for a in argv if a.startswith("--")}
    assert used <= real, used - real
    assert {"--prefill-dns", "--decode-dns", "--health-interval", "--drain-timeout"} <= used
    state = next(p for p in cmd.commands["router"].params if "--state" in p.opts)  # type: ignore[attr-defined]
    assert state.envvar == "KVFERRY_STATE_URL"  # the Secret's URL reaches it as env, not argv


def test_every_source_named_is_used_and_files_carry_them() -> None:
    files = render_all(CASES["trn2-dra"], SECRET) + render_all(CASES["p5en"], SECRET) \
        + render_all(CASES["p5en-keda"], SECRET)
    used = {s for m in files for s in m.sources}
    assert used == set(SOURCES)
    dep = next(m for m in files if m.filename == "prefill-deployment.yaml")
    assert "# follows: aws-neuron/aws-neuron-eks-samples disagg_serve_vllm" in dep.render()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(PlanError, match="router-replicas"):
        render_all(K8sSettings("p5en.48xlarge", "m", tp=4, router_replicas=1), SECRET)
    with pytest.raises(PlanError, match="dra is for trn2"):
        render_all(K8sSettings("p5en.48xlarge", "m", tp=4, neuron_devices="dra"), SECRET)
    with pytest.raises(PlanError, match="cannot span instances"):
        render_all(K8sSettings("p5en.48xlarge", "m", tp=16), SECRET)
    with pytest.raises(PlanError, match="unknown instance"):
        render_all(K8sSettings("trn1.32xlarge", "m"), SECRET)


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.add_typer(launch_app, name="launch")

    @app.command()
    def version() -> None:  # a second command so "launch" stays a sub-command
        pass
    return app


def test_cli_writes_the_directory_and_prints_the_secret_only_on_dry_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_SECRET", SECRET)
    out = tmp_path / "k8s"
    base = ["launch", "--target", "k8s", "--model", "m", "-i", "trn2.48xlarge", "--tp", "16",
            "--prefill", "2", "--decode", "2"]
    r = CliRunner().invoke(_cli(), [*base, "--out-dir", str(out)])
    assert r.exit_code == 0, r.output
    assert SECRET not in r.output and "kubectl apply -k" in r.output
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    written = sorted(p.name for p in out.iterdir())
    assert sorted([*kust["resources"], "kustomization.yaml"]) == written
    for name in kust["resources"]:
        assert [d for d in yaml.safe_load_all((out / name).read_text()) if d]
    assert (out / "secret.yaml").stat().st_mode & 0o777 == 0o600
    r = CliRunner().invoke(_cli(), [*base, "--dry-run"])
    assert r.exit_code == 0, r.output
    assert f"KVFERRY_SECRET: {SECRET}" in r.output
    docs = [d for d in yaml.safe_load_all(r.output) if d]
    assert {d["kind"] for d in docs} >= {"Kustomization", "Deployment", "Secret"}
    r = CliRunner().invoke(_cli(), [*base, "--router-replicas", "1", "--dry-run"])
    assert r.exit_code == 2 and "router-replicas" in r.output
    r = CliRunner().invoke(_cli(), [*base, "--target", "helm"])
    assert r.exit_code == 2


@pytest.mark.parametrize("case", ["trn2-dra", "p5en"])
def test_kubectl_kustomize_renders(case: str, tmp_path: Path) -> None:
    """Runs wherever the tests run: .ci/setup-tests installs kubectl (Debian's
    kubernetes-client, kustomize built in) when none is there."""
    assert shutil.which("kubectl"), "no kubectl: run bash .ci/setup-tests"
    s = CASES[case]
    files = render_all(K8sSettings(**{**s.__dict__, "image": "123.dkr.ecr.aws/kvferry:0.1.0",
                                      "namespace": "serving"}), SECRET)
    write_dir(tmp_path, files)
    out = subprocess.run(["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    expect = {(o["kind"], o["metadata"]["name"]) for o in objects(files)}
    assert {(d["kind"], d["metadata"]["name"]) for d in docs} == expect
    assert all(d["metadata"]["namespace"] == "serving" for d in docs)
    images = {c["image"] for d in docs if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {"123.dkr.ecr.aws/kvferry:0.1.0", "kvferry-router:0.1.0",
                      s.redis_image}  # each role's image, no placeholder left
    for d in docs:  # what kustomize emits still validates
        validate(d)


def _adapter_values(files) -> dict[str, Any]:
    """The Prometheus Adapter values autoscaling.yaml carries in its header comment."""
    text = next(m for m in files if m.filename == "autoscaling.yaml").render()
    head = text.split("\napiVersion:", 1)[0].splitlines()
    start = head.index("# rules:")
    return yaml.safe_load("\n".join(ln[2:] for ln in head[start:]))


def _vllm_metric_names() -> str:
    """vLLM's metrics module as text (read, not imported: importing vLLM is slow)."""
    import importlib.util

    origin = importlib.util.find_spec("vllm").origin  # type: ignore[union-attr]
    return (Path(origin).parent / "v1" / "metrics" / "loggers.py").read_text()


def test_hpas_scale_each_engine_role_on_exported_metrics_and_drain() -> None:
    from kvferry.router.metrics import RouterMetrics

    s = CASES["trn2-plugin"]
    files = render_all(s, SECRET)
    hpas = {o["metadata"]["name"]: o for o in by_kind(files, "HorizontalPodAutoscaler")}
    assert set(hpas) == {"kvferry-prefill", "kvferry-decode"}
    values = _adapter_values(files)
    pods_rules = {r["name"]["as"]: r for r in values["rules"]["custom"]}
    ext_rules = {r["name"]["as"]: r for r in values["rules"]["external"]}
    vllm_src = _vllm_metric_names()
    router_text = RouterMetrics().render().decode()
    for role, count in (("prefill", s.prefill), ("decode", s.decode)):
        spec = hpas[f"kvferry-{role}"]["spec"]
        target = spec["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", deployment(files, role)["metadata"]["name"])
        assert (spec["minReplicas"], spec["maxReplicas"]) == (count, 2 * count)
        up, down = spec["behavior"]["scaleUp"], spec["behavior"]["scaleDown"]
        # against flapping: a dip must last longer than a burst before engines go
        assert 0 < up["stabilizationWindowSeconds"] < down["stabilizationWindowSeconds"]
        # scale-down drains: one engine per drain window (its preStop is that long)
        assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": s.drain_s}]
        assert down["selectPolicy"] == "Min" and up["policies"][0]["value"] == 1
        kinds = set()
        for m in spec["metrics"]:
            kinds.add(m["type"])
            if m["type"] == "Pods":
                rule = pods_rules[m["pods"]["metric"]["name"]]
                series = rule["name"]["matches"].strip("^$")
                assert f'"{series}"' in vllm_src  # a metric vLLM's engines export
                assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
            else:
                ext = m["external"]
                assert ext["metric"]["selector"]["matchLabels"] == {"role": role}
                series = ext_rules[ext["metric"]["name"]]["name"]["matches"].strip("^$")
                assert f"# TYPE {series} gauge" in router_text  # the router's /metrics
            assert m[m["type"].lower()]["target"]["type"] == "AverageValue"
        assert kinds == {"Pods", "External"}  # engines' and router's measures both
    names = {m["pods"]["metric"]["name"] for m in hpas["kvferry-decode"]["spec"]["metrics"]
             if m["type"] == "Pods"}
    assert names == {"kvferry_engine_requests_running", "kvferry_engine_kv_cache_usage"}


def test_keda_scaled_objects_behind_the_flag() -> None:
    s = CASES["p5en-keda"]
    files = render_all(s, SECRET)
    assert not by_kind(files, "HorizontalPodAutoscaler")  # KEDA makes its own
    sos = {o["metadata"]["name"]: o["spec"] for o in by_kind(files, "ScaledObject")}
    assert set(sos) == {"kvferry-prefill", "kvferry-decode"}
    assert (sos["kvferry-decode"]["minReplicaCount"], sos["kvferry-decode"]["maxReplicaCount"]) == (3, 9)
    assert (sos["kvferry-prefill"]["minReplicaCount"], sos["kvferry-prefill"]["maxReplicaCount"]) == (2, 4)
    for role, spec in (("prefill", sos["kvferry-prefill"]), ("decode", sos["kvferry-decode"])):
        assert spec["scaleTargetRef"]["name"] == f"kvferry-{role}"
        down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert down["policies"][0]["periodSeconds"] == s.drain_s == 120
        for t in spec["triggers"]:
            assert t["type"] == "prometheus" and t["metadata"]["serverAddress"] == s.prometheus_url
            q = t["metadata"]["query"]
            assert 'namespace="kvferry"' in q and (f'service="kvferry-{role}"' in q
                                                   or f'role="{role}"' in q)
            float(t["metadata"]["threshold"])
        assert {t["metadata"]["threshold"] for t in spec["triggers"]} >= (
            {"2", "4"} if role == "prefill" else {"32", "0.8"})


def test_the_validators_catch_autoscaling_mistakes() -> None:
    hpa = copy.deepcopy(by_kind(render_all(CASES["p5en"], SECRET), "HorizontalPodAutoscaler")[0])
    hpa["spec"]["behavior"]["scaleDown"]["stabilisationWindowSeconds"] = 60
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(hpa)
    so = copy.deepcopy(by_kind(render_all(CASES["p5en-keda"], SECRET), "ScaledObject")[0])
    so["spec"]["maxReplicas"] = 4
    with pytest.raises(jsonschema.ValidationError):
        validate(so)
    so = copy.deepcopy(by_kind(render_all(CASES["p5en-keda"], SECRET), "ScaledObject")[0])
    del so["spec"]["triggers"][0]["type"]
    with pytest.raises(jsonschema.ValidationError):  # the CRD requires each trigger's type
        validate(so)


def test_bad_autoscaling_settings_are_refused() -> None:
    with pytest.raises(PlanError, match="--max-decode"):
        render_all(K8sSettings("p5en.48xlarge", "m", tp=4, decode=3, max_decode=2), SECRET)
    with pytest.raises(PlanError, match="--autoscaler"):
        render_all(K8sSettings("p5en.48xlarge", "m", tp=4, autoscaler="vpa"), SECRET)
    with pytest.raises(PlanError, match="scaling targets"):
        render_all(K8sSettings("p5en.48xlarge", "m", tp=4, scale_decode_kv_usage=1.5), SECRET)


def test_cli_autoscaling_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_SECRET", SECRET)
    base = ["launch", "--target", "k8s", "--model", "m", "-i", "p5en.48xlarge", "--tp", "8",
            "--dry-run"]
    r = CliRunner().invoke(_cli(), [*base, "--autoscaler", "keda", "--max-decode", "6",
                                    "--scale-decode-running", "48", "--prometheus-url",
                                    "http://prom.mon:9090", "--router-image", "r/router:1"])
    assert r.exit_code == 0, r.output
    docs = [d for d in yaml.safe_load_all(r.output) if d]
    so = next(d for d in docs if d["kind"] == "ScaledObject" and d["metadata"]["name"] == "kvferry-decode")
    assert so["spec"]["maxReplicaCount"] == 6
    assert so["spec"]["triggers"][0]["metadata"] == {
        "serverAddress": "http://prom.mon:9090",
        "query": 'sum(vllm:num_requests_running{namespace="kvferry",service="kvferry-decode"})',
        "threshold": "48"}
    kust = next(d for d in docs if d["kind"] == "Kustomization")
    assert {"name": "kvferry-router", "newName": "r/router", "newTag": "1"} in kust["images"]
    r = CliRunner().invoke(_cli(), [*base, "--autoscaler", "none"])
    assert r.exit_code == 0 and "HorizontalPodAutoscaler" not in r.output
    r = CliRunner().invoke(_cli(), [*base, "--autoscaler", "vpa"])
    assert r.exit_code == 2 and "--autoscaler" in r.output
