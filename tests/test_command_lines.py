"""Every command line a launch generates is parsed by the real CLI it targets.

The ssh target's host scripts (``HostPlan.script``: the very lines ``nohup`` starts) and the
Kubernetes containers (``render_all``) for 1P1D, 2P2D and mixed TP: ``kvferry router``
lines through kvferry's typer app up to the RouterSettings it would serve, engine lines
through vLLM's own serve parser, built as ``python -m vllm.entrypoints.openai.api_server``
builds it (parse, then vLLM's pre-start checks and EngineArgs). Nothing is started: the
router's ``serve`` is replaced by a recorder, vLLM is only asked to parse."""

from __future__ import annotations

import argparse
import shlex
import subprocess
from typing import Any

import pytest
from typer.testing import CliRunner

from kvferry.router.settings import RouterSettings
from kvferry.scripts import cli
from kvferry.scripts.k8s import render_all
from kvferry.scripts.k8s_settings import K8sSettings
from kvferry.scripts.plan import plan

SECRET = "s3cret-for-tests"
ENGINE_MODULE = ["-m", "vllm.entrypoints.openai.api_server"]

# name: (hosts, instance type, P, D, TP, decode TP)
TOPOLOGIES: dict[str, tuple[list[str], str, int, int, int, int | None]] = {
    "p5en-1p1d": (["g0"], "p5en.48xlarge", 1, 1, 4, None),
    "p5en-2p2d": (["g0", "g1"], "p5en.48xlarge", 2, 2, 4, None),
    "p5en-mixed-tp": (["g0", "g1"], "p5en.48xlarge", 2, 1, 2, 8),
    "trn2-2p2d": (["t0"], "trn2.48xlarge", 2, 2, 16, None),
    "trn2-mixed-tp": (["t0", "t1"], "trn2.48xlarge", 3, 1, 16, 64),
}


def vllm_serve_args(args: list[str]) -> argparse.Namespace:
    """vLLM's own parsing of an engine's arguments, as its api_server ``main`` does it
    (FlexibleArgumentParser + make_arg_parser, then validate_parsed_serve_args), then
    the EngineArgs it would build; a refused line raises (argparse exits with 2)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM server"))
    ns = parser.parse_args(args)
    validate_parsed_serve_args(ns)
    AsyncEngineArgs.from_cli_args(ns)
    return ns


def router_settings(args: list[str], monkeypatch: pytest.MonkeyPatch) -> RouterSettings:
    """What ``kvferry router ARGS`` would serve: the real typer app, ``serve`` recorded."""
    from kvferry.router.api import server as router_server

    seen: list[RouterSettings] = []
    monkeypatch.setattr(router_server, "serve", lambda settings, **kw: seen.append(settings))
    r = CliRunner().invoke(cli.app, ["router", *args])
    assert r.exit_code == 0, f"kvferry router refused {shlex.join(args)}:\n{r.output}"
    (settings,) = seen
    return settings


def started_commands(script: str) -> list[list[str]]:
    """The argv of every process a host script starts (``nohup [env K=V...] ARGV > log &``)."""
    out = []
    for line in script.splitlines():
        if not line.startswith("nohup "):
            continue
        words = shlex.split(line)[1:]
        words = words[:next(i for i, w in enumerate(words) if w.startswith(">"))]
        if words[0] == "env":
            words = words[1:]
            while "=" in words[0]:
                words = words[1:]
        out.append(words)
    return out


def check_engine(argv: list[str], python: str) -> argparse.Namespace:
    assert argv[0] == python and argv[1:3] == ENGINE_MODULE, argv
    ns = vllm_serve_args(argv[3:])
    assert ns.kv_transfer_config.kv_connector == "KvferryConnector"
    return ns


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_ssh_scripts_start_lines_the_router_and_vllm_accept(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    hosts, itype, n_p, n_d, tp, decode_tp = TOPOLOGIES[name]
    plans = plan(hosts, itype, n_p, n_d, tp, "Qwen/Qwen3-0.6B", decode_tp=decode_tp,
                 python="python3")
    engines = {e.url: e for p in plans for e in p.engines}
    routers: list[RouterSettings] = []
    parsed: dict[str, argparse.Namespace] = {}
    for p in plans:
        script = p.script(SECRET)
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
        for argv in started_commands(script):
            if argv[:2] == ["kvferry", "router"]:
                routers.append(router_settings(argv[2:], monkeypatch))
            else:
                ns = check_engine(argv, "python3")
                parsed[f"http://{p.host}:{ns.port}"] = ns
    assert parsed.keys() == engines.keys()  # every engine started, each once
    for url, ns in parsed.items():
        e = engines[url]
        assert ns.tensor_parallel_size == len(e.devices) and ns.model == "Qwen/Qwen3-0.6B"
        extra = ns.kv_transfer_config.kv_connector_extra_config
        assert (extra["side_channel_host"], extra["side_channel_port"]) == (
            e.host, e.side_channel_port)
    (router,) = routers
    by_role = {r: [e for e in engines.values() if e.role == r] for r in ("prefill", "decode")}
    assert router.prefill_urls == [e.url for e in by_role["prefill"]]
    assert router.decode_urls == [e.url for e in by_role["decode"]]
    assert len(by_role["prefill"]) == n_p and len(by_role["decode"]) == n_d
    for e in by_role["prefill"]:  # push reaches each P's own side channel
        assert router.prefill_kv_addr(e.url) == (e.host, e.side_channel_port)
    assert router.decode_control_addrs == [f"{e.host}:{e.spec.control_port}"
                                           for e in by_role["decode"]]


def container_argv(command: list[str]) -> list[str]:
    """A container's process: the command itself, or what its bash prelude ``exec``s."""
    if command[:2] != ["/bin/bash", "-c"]:
        return command
    last = command[2].splitlines()[-1]
    assert last.startswith("exec "), last
    return shlex.split(last)[1:]


def containers(files: Any) -> dict[str, list[str]]:
    return {o["metadata"]["name"]: container_argv(c["command"])
            for m in files for o in m.objects if o["kind"] == "Deployment"
            for c in o["spec"]["template"]["spec"]["containers"] if c["name"] != "redis"}


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_k8s_containers_run_lines_the_router_and_vllm_accept(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _, itype, n_p, n_d, tp, decode_tp = TOPOLOGIES[name]
    s = K8sSettings(instance_type=itype, model="Qwen/Qwen3-0.6B", prefill=n_p, decode=n_d,
                    tp=tp, decode_tp=decode_tp)
    cmds = containers(render_all(s, SECRET))
    assert set(cmds) == {"kvferry-prefill", "kvferry-decode", "kvferry-router"}
    for role in ("prefill", "decode"):
        ns = check_engine(cmds[f"kvferry-{role}"], "python")
        want_tp = decode_tp or tp if role == "decode" else tp
        assert ns.tensor_parallel_size == want_tp and ns.host == "0.0.0.0"
    router = router_settings(cmds["kvferry-router"][2:], monkeypatch)
    assert router.prefill_dns == [f"kvferry-prefill:{s.http_port}"]
    assert router.decode_dns == [f"kvferry-decode:{s.http_port}"]


def test_a_line_vllm_refuses_is_caught() -> None:
    """The parser is vLLM's own: an unknown flag or a bad value is refused, not ignored."""
    with pytest.raises(SystemExit):
        vllm_serve_args(["--model", "m", "--no-such-flag"])
    with pytest.raises(SystemExit):
        vllm_serve_args(["--model", "m", "--tensor-parallel-size", "two"])
