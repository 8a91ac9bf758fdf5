"""CLI and engine launch: argv/env per backend and connector, and `up`'s supervision.

No vLLM engine is started: `up`/`run` are exercised with fake engine processes.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers_http import free_port
from typer.testing import CliRunner

from kvferry.router.settings import RouterSettings
from kvferry.scripts import cli, up_stack
from kvferry.scripts.engines import (
    EngineSpec,
    cpu_share,
    engine_argv,
    engine_env,
    format_ranges,
    kv_transfer_config,
)
from kvferry.scripts.procs import Child, stop_all
from kvferry.scripts.up_stack import up_engines

HELPERS = Path(__file__).with_name("helpers_http.py")
runner = CliRunner()


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("role,side,bind", [("prefill", 5600, "0"), ("decode", 5602, "1")])
def test_cpu_kvferry_engine(role: str, side: int, bind: str, tmp_path: Path) -> None:
    model = str(tmp_path)  # a config-only model dir: vLLM's dummy weights
    spec = EngineSpec(role=role, model=model, port=8100, cpus=(0, 1),  # type: ignore[arg-type]
                      side_channel_port=side)
    argv = engine_argv(spec)
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--model") == model and _flag(argv, "--port") == "8100"
    assert _flag(argv, "--load-format") == "dummy" and _flag(argv, "--seed") == "0"
    assert _flag(argv, "--max-model-len") == "4096" and "--enforce-eager" in argv
    assert _flag(argv, "--tensor-parallel-size") == "1"
    kv = json.loads(_flag(argv, "--kv-transfer-config"))
    assert kv == {
        "kv_connector": "KvferryConnector",
        "kv_connector_module_path": "kvferry.connectors.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        # the lease-control port right after the one TP rank's side channel
        "kv_connector_extra_config": {"hardware_backend": "cpu", "side_channel_host": "127.0.0.1",
                                      "side_channel_port": side, "lease_control_port": side + 1},
    }
    assert engine_env(spec) == {
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "OMP_WAIT_POLICY": "PASSIVE",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "KVFERRY_DETOKENIZE_WINDOW": "32",  # connectors/detokenizer_window.py
    }


def test_cpu_vllm_nixl_and_ucx() -> None:
    p = EngineSpec(role="prefill", model="/m", port=1, connector="vllm-nixl", cpus=(0, 1),
                   ucx_tls="tcp,self")
    d = EngineSpec(role="decode", model="/m", port=2, connector="vllm-nixl", cpus=(0, 1),
                   side_channel_port=p.next_side_channel_port)
    assert kv_transfer_config(p) == {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                     "kv_buffer_device": "cpu", "engine_id": "prefill-127.0.0.1-1"}
    push = EngineSpec(role="decode", model="/m", port=2, connector="vllm-nixl", mode="push",
                      connector_extra={"bidirectional_kv_xfer": True})
    assert kv_transfer_config(push)["kv_connector"] == "NixlPushConnector"
    assert kv_transfer_config(push)["kv_connector_extra_config"] == {"bidirectional_kv_xfer": True}
    pe, de = engine_env(p), engine_env(d)
    assert pe["VLLM_NIXL_SIDE_CHANNEL_PORT"] != de["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert pe["UCX_TLS"] == "tcp,self" and "UCX_TLS" not in de


def test_cuda_and_neuron() -> None:
    p = EngineSpec(role="prefill", model="/m", port=1, backend="cuda", connector="vllm-nixl")
    d = EngineSpec(role="decode", model="/m", port=2, backend="cuda", devices_per_engine=2)
    assert engine_env(p)["CUDA_VISIBLE_DEVICES"] == "0"
    assert engine_env(d)["CUDA_VISIBLE_DEVICES"] == "2,3"
    p1 = EngineSpec(role="prefill", model="/m", port=3, backend="cuda", devices=(1,))
    assert engine_env(p1)["CUDA_VISIBLE_DEVICES"] == "1"  # 2P2D: a second P on GPU 1
    assert kv_transfer_config(p)["kv_buffer_device"] == "cuda"
    assert _flag(engine_argv(d), "--tensor-parallel-size") == "2"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine_env(p)
    assert kv_transfer_config(d)["kv_connector_extra_config"]["hardware_backend"] == "cuda"
    n = EngineSpec(role="decode", model="/m", port=2, backend="neuron", devices_per_engine=4)
    env = engine_env(n)
    # vllm-neuron's multiprocess worker refuses NEURON_RT_VISIBLE_CORES (same env as launch)
    assert "NEURON_RT_VISIBLE_CORES" not in env
    assert env["NEURON_VISIBLE_DEVICES"] == "4-7" and env["FI_EFA_ENABLE_SHM_TRANSFER"] == "0"
    assert env["NEURON_RT_ROOT_COMM_ID"] == "localhost:61238"
    assert kv_transfer_config(n)["kv_connector_extra_config"]["hardware_backend"] == "neuron"


def test_eager_only_where_asked_or_on_cpu() -> None:
    """CUDA engines keep CUDA graphs (an eager decode step is Python-bound); CPU stays eager."""
    cuda = EngineSpec(role="decode", model="/m", port=2, backend="cuda")
    assert "--enforce-eager" not in engine_argv(cuda)
    assert "--enforce-eager" in engine_argv(EngineSpec(role="decode", model="/m", port=2,
                                                       backend="cuda", eager=True))
    assert "--enforce-eager" not in engine_argv(EngineSpec(role="decode", model="/m", port=2,
                                                           cpus=(0, 1), eager=False))


def test_dummy_weights_only_for_a_local_model_dir_without_weights(tmp_path: Path) -> None:
    """modelgen's config-only dirs run vLLM's dummy init; a dir with (sharded) weights, an
    HF id, or a launch's remote path load real weights (vLLM's default, no flag)."""
    def load_format(model: str, **kw: object) -> str | None:
        argv = engine_argv(EngineSpec(role="prefill", model=model, port=1, cpus=(0,), **kw))  # type: ignore[arg-type]
        return _flag(argv, "--load-format") if "--load-format" in argv else None

    empty, sharded = tmp_path / "config-only", tmp_path / "sharded"
    empty.mkdir()
    sharded.mkdir()
    (empty / "config.json").write_text("{}")
    (sharded / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert load_format(str(empty)) == "dummy"
    assert load_format(str(sharded)) is None  # was dummy: only model.safetensors counted
    assert load_format("Qwen/Qwen3-0.6B") is None  # was dummy: a hub id is no local dir
    assert load_format(str(empty), model_on_this_host=False) is None


def test_cpu_splits() -> None:
    assert [cpu_share((0, 1), i) for i in (0, 1)] == ["0", "1"]
    assert [cpu_share(tuple(range(8)), i) for i in (0, 1)] == ["0-3", "4-7"]
    assert [cpu_share((0, 1, 2), i) for i in (0, 1)] == ["0", "1-2"]
    assert cpu_share((0,), 1) == "0"
    assert format_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"


def test_cpu_tp_engine_binds_each_rank_and_ports_leave_room_for_ranks() -> None:
    """A CPU engine with TP ranks: vLLM's '|'-separated bind, one slice per rank, and
    --tensor-parallel-size; `up`'s P ranks and lease control never reach D's ports, for
    any TP (D used to sit at a fixed 5616, which a P of TP >= 16 overran)."""
    spec = EngineSpec(role="prefill", model="/m", port=1, cpus=tuple(range(8)),
                      devices_per_engine=2)
    assert engine_env(spec)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    assert _flag(engine_argv(spec), "--tensor-parallel-size") == "2"
    small = EngineSpec(role="decode", model="/m", port=1, cpus=(0, 1), devices_per_engine=2)
    assert engine_env(small)["VLLM_CPU_OMP_THREADS_BIND"] == "1|1"
    for p_tp, d_tp in ((1, 1), (2, 1), (16, 4), (64, 64)):  # up to a trn2's 64 NeuronCores
        specs = up_engines("/m", "neuron", {"prefill": 1, "decode": 2},
                           {"prefill": p_tp, "decode": d_tp})
        p, d = specs["prefill"], specs["decode"]
        assert list(p.side_ports) == list(range(5600, 5600 + p_tp))
        assert p.control_port == 5600 + p_tp == p.side_port + p.tp  # the connector's default
        assert d.side_port == p.control_port + 1 and d.control_port == d.side_port + d_tp
        assert not set(p.ports) & set(d.ports)


def test_dry_run_with_another_decode_tp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """P on two GPUs (TP 2), D on the third (TP 1): devices are numbered P first."""
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(cli.app, ["up", "--dry-run", "--hardware-backend", "cuda",
                                "--devices-per-engine", "2", "--decode-devices", "1"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    p_cmd = lines[lines.index(next(x for x in lines if x.startswith("# prefill"))) + 1]
    d_cmd = lines[lines.index(next(x for x in lines if x.startswith("# decode"))) + 1]
    assert "CUDA_VISIBLE_DEVICES=0,1" in p_cmd and "--tensor-parallel-size 2" in p_cmd
    assert "CUDA_VISIBLE_DEVICES=2" in d_cmd and "--tensor-parallel-size 1" in d_cmd


def test_up_gives_the_router_its_state_url_as_env(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvferry up --state redis://...`: the router shares conversations through Redis; the
    URL (which may carry a password) goes in the router's environment, not its argv."""
    monkeypatch.chdir(tmp_path)
    url = "redis://:pw@127.0.0.1:6390/0"
    r = runner.invoke(cli.app, ["up", "--dry-run", "--state", url])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    router = lines[lines.index(next(x for x in lines if x.startswith("# router"))) + 1]
    env, _, argv = router.partition(" /")
    assert f"KVFERRY_STATE_URL={url}" in env and url not in argv and "--state" not in argv
    assert "KVFERRY_STATE_URL" not in r.output.replace(router, "")  # engines don't get it
    plain = runner.invoke(cli.app, ["up", "--dry-run"])
    assert plain.exit_code == 0 and "KVFERRY_STATE_URL" not in plain.output


def test_up_router_workers_line_is_parsed_by_the_router(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvferry up --router-workers 3`: the router line `up` prints is accepted by `kvferry
    router` as 3 workers with no --state (they share a SQLite file, router/api/workers.py)."""
    from kvferry.router.api import workers as router_workers

    monkeypatch.chdir(tmp_path)
    r = runner.invoke(cli.app, ["up", "--dry-run", "--router-workers", "3"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    line = lines[lines.index(next(x for x in lines if x.startswith("# router"))) + 1]
    argv = shlex.split(line)
    args = argv[argv.index("router") + 1:]
    assert args[args.index("--workers") + 1] == "3" and "--state" not in args
    seen: list[tuple[RouterSettings, int]] = []
    monkeypatch.setattr(router_workers, "serve_workers",
                        lambda settings, host, port, level, n: seen.append((settings, n)) or 0)
    assert runner.invoke(cli.app, ["router", *args]).exit_code == 0
    assert seen[0][1] == 3 and seen[0][0].state == "memory"
    plain = runner.invoke(cli.app, ["up", "--dry-run"])
    assert plain.exit_code == 0 and "--workers" not in plain.output


def test_help_and_dry_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(cli.app, ["--help"])
    assert r.exit_code == 0 and "up" in r.output and "demo" in r.output
    for cmd in ("up", "run", "router", "demo", "model"):
        assert runner.invoke(cli.app, [cmd, "--help"]).exit_code == 0
    r = runner.invoke(cli.app, ["up", "--dry-run", "--mode", "push", "--prefill-port", "9100",
                                "--engine-arg", "--block-size 16", "--", "--foo"])
    assert r.exit_code == 0, r.output
    assert "--port 9100" in r.output and "--block-size 16 --foo" in r.output
    assert "--mode push" in r.output and "--prefill-kv 127.0.0.1:5600" in r.output
    # P, D and the router share one secret (D checks P's offers, the router signs lease
    # requests to D): a router without it saw every lease refused (bad_signature).
    keys = re.findall(r"KVFERRY_SECRET=(\S+)", r.output)
    assert len(keys) == 3 and len(set(keys)) == 1, keys
    r = runner.invoke(cli.app, ["up", "--dry-run", "--connector", "vllm-nixl"])
    assert r.exit_code == 0 and "--prefill-kv" not in r.output
    bad = runner.invoke(cli.app, ["up", "--dry-run", "--hardware-backend", "tpu"])
    assert bad.exit_code != 0
    # vLLM's own push connector: the router names P's engine id to D before P answers.
    r = runner.invoke(cli.app, ["up", "--dry-run", "--mode", "push", "--connector", "vllm-nixl"])
    assert r.exit_code == 0, r.output
    assert "NixlPushConnector" in r.output and "--prefill-kv 127.0.0.1:5600" in r.output
    assert "--prefill-engine-id prefill-127.0.0.1-8100" in r.output


def test_up_sets_kv_checksums_on_both_engines(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvferry up --kv-checksums all`: both engines' connector config says so, and the
    connector's own config model accepts what the line carries."""
    from kvferry.connectors.config import ConnectorConfig

    monkeypatch.chdir(tmp_path)
    r = runner.invoke(cli.app, ["up", "--dry-run", "--kv-checksums", "all"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    for role in ("prefill", "decode"):
        line = lines[lines.index(next(x for x in lines if x.startswith(f"# {role}"))) + 1]
        extra = json.loads(_flag(shlex.split(line), "--kv-transfer-config"))[
            "kv_connector_extra_config"]
        assert extra["kv_checksums"] == "all"
        assert ConnectorConfig.from_extra(extra).kv_checksums == "all"
    plain = runner.invoke(cli.app, ["up", "--dry-run"])
    assert plain.exit_code == 0 and '"kv_checksums"' not in plain.output  # default: sample
    assert ConnectorConfig().kv_checksums == "sample"
    assert runner.invoke(cli.app, ["up", "--dry-run", "--kv-checksums", "most"]).exit_code != 0
    other = runner.invoke(cli.app, ["up", "--dry-run", "--kv-checksums", "all", "--connector",
                                    "vllm-nixl"])
    assert other.exit_code == 2 and "kvferry's connector" in other.output


def test_router_command_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvferry.router.api import server as router_server

    seen: list[RouterSettings] = []
    monkeypatch.setattr(router_server, "serve", lambda settings, **kw: seen.append(settings))
    r = runner.invoke(cli.app, ["router", "--prefill", "http://a:1,http://b:2", "--decode",
                                "http://c:3", "--mode", "push", "--prefill-kv", "10.0.0.1:5600",
                                "--prefill-kv", "10.0.0.2:5600"])
    assert r.exit_code == 0, r.output
    assert seen[0].mode == "push"
    assert seen[0].prefill_kv_addr("http://b:2") == ("10.0.0.2", 5600)
    r = runner.invoke(cli.app, ["router", "--prefill", "http://a:1", "--decode", "http://c:3",
                                "--mode", "push"])
    assert r.exit_code != 0 and len(seen) == 1  # push without --prefill-kv: refused
    r = runner.invoke(cli.app, ["router", "--prefill", "http://a:1", "--decode", "http://c:3",
                                "--prefill-kv", "h:5600", "--prefill-engine-id", "pe"])
    assert r.exit_code == 0, r.output
    assert seen[-1].push_identity("http://a:1", "r1") == {"remote_engine_id": "pe", "tp_size": 1,
                                                          "remote_request_id": "r1"}
    assert seen[-1].push_identity("http://zz:1", "r1") == {}
    r = runner.invoke(cli.app, ["router", "--prefill", "http://a:1", "--decode", "http://c:3",
                                "--prefill-engine-id", "pe", "--prefill-engine-id", "pf"])
    assert r.exit_code != 0  # two ids for one prefill


def test_router_max_migrations(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--max-migrations` (or $KVFERRY_MAX_MIGRATIONS) sets RouterSettings.max_migrations;
    the default is the settings' own; a negative count is refused."""
    from kvferry.router.api import server as router_server

    seen: list[RouterSettings] = []
    monkeypatch.setattr(router_server, "serve", lambda settings, **kw: seen.append(settings))
    monkeypatch.delenv("KVFERRY_MAX_MIGRATIONS", raising=False)
    base = ["router", "--prefill", "http://a:1", "--decode", "http://c:3"]
    assert runner.invoke(cli.app, base).exit_code == 0
    default = RouterSettings.model_fields["max_migrations"].default
    assert seen[-1].max_migrations == default
    r = runner.invoke(cli.app, [*base, "--max-migrations", "0"])
    assert r.exit_code == 0, r.output
    assert seen[-1].max_migrations == 0
    r = runner.invoke(cli.app, base, env={"KVFERRY_MAX_MIGRATIONS": "5"})
    assert r.exit_code == 0, r.output
    assert seen[-1].max_migrations == 5
    n = len(seen)
    r = runner.invoke(cli.app, [*base, "--max-migrations", "-1"])
    assert r.exit_code != 0 and len(seen) == n


def test_model_command(tmp_path: Path) -> None:
    r = runner.invoke(cli.app, ["model", str(tmp_path / "m"), "--shape", "tiny"])
    assert r.exit_code == 0 and (tmp_path / "m" / "config.json").is_file()
    assert runner.invoke(cli.app, ["model", str(tmp_path / "x"), "--shape", "nope"]).exit_code


def _fake_engines(monkeypatch: pytest.MonkeyPatch, crash: str | None = None) -> None:
    def argv(spec: EngineSpec) -> list[str]:
        if spec.role == crash:
            return [sys.executable, "-c", "print('boom: no accelerator'); raise SystemExit(3)"]
        return [sys.executable, str(HELPERS), str(spec.port), spec.role]

    monkeypatch.setattr(up_stack, "engine_argv", argv)


def _ports() -> list[str]:
    p, d, r = free_port(), free_port(), free_port()
    return ["--prefill-port", str(p), "--decode-port", str(d), "--router-port", str(r)]


def test_run_with_fake_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _fake_engines(monkeypatch)
    r = runner.invoke(cli.app, ["run", "--startup-timeout", "60", *_ports()])
    assert r.exit_code == 0, r.output
    assert "turn 4: ttft" in r.output and "demo ok" in r.output
    assert "all processes stopped" in r.output
    assert (tmp_path / ".kvferry" / "models" / "tiny" / "config.json").is_file()
    assert (tmp_path / ".kvferry" / "logs" / "router.log").is_file()


def test_up_reports_engine_death(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _fake_engines(monkeypatch, crash="decode")
    t0 = time.monotonic()
    r = runner.invoke(cli.app, ["up", "--demo", "--startup-timeout", "60", *_ports()])
    assert r.exit_code == 1
    assert time.monotonic() - t0 < 30
    assert "decode exited with code 3" in r.output and "boom: no accelerator" in r.output


def test_stop_all_kills_whole_group(tmp_path: Path) -> None:
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(p.pid, flush=True); time.sleep(60)")
    child = Child("x", [sys.executable, "-c", code], tmp_path / "x.log")
    child.start()
    deadline = time.monotonic() + 10
    while not (tmp_path / "x.log").read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int((tmp_path / "x.log").read_text().split()[0])
    stop_all([child], grace_s=5)
    assert not child.alive()
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(grandchild, 0)
        # a zombie still answers kill(0); make sure it is not a live process
        if Path(f"/proc/{grandchild}/stat").read_text().split()[2] == "Z":
            raise ProcessLookupError


def _read_until(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> list[str]:
    """Lines of proc's stdout up to the one containing `marker` (or EOF / timeout)."""
    assert proc.stdout is not None
    lines: list[str] = []
    done = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if marker in line:
                break
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    done.wait(timeout_s)
    return lines


def _logs(root: Path) -> str:
    return "".join(f"\n--- {p.name}:\n{p.read_text(errors='replace')[-3000:]}"
                   for p in sorted((root / ".kvferry" / "logs").glob("*.log")))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_up_started_with_ampersand_stops_on_sigint_and_sigterm(
        tmp_path: Path, sig: signal.Signals) -> None:
    """A real `kvferry up` process started as `kvferry up &` by a non-interactive shell
    (which starts it with SIGINT ignored): SIGINT and SIGTERM each stop it and its
    children (fake engines); the exit code is 128 + the signal's number.

    Robust under CPU load: the model dir is given (no tokenizer training or torch weight
    generation in the timed part; fake engines ignore it), start-up gets minutes, and a
    failure shows `up`'s output and every child's log.
    """
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); h = sys.argv[2];"
        "from kvferry.scripts import cli, up_stack;"
        "up_stack.engine_argv = lambda s: [sys.executable, h, str(s.port), s.role];"
        "sys.argv = ['kvferry', 'up', *sys.argv[3:]]; cli.main()"
    )
    background = '"$@" & echo "up-pid $!"; wait $!'
    probe = subprocess.run(["bash", "-c", "sleep 5 & grep SigIgn /proc/$!/status; kill $!"],
                           capture_output=True, text=True, check=True).stdout
    assert int(probe.split()[1], 16) & (1 << (signal.SIGINT - 1)), probe  # the premise
    proc = subprocess.Popen(
        ["bash", "-c", background, "bash", sys.executable, "-c", script, str(HELPERS.parent),
         str(HELPERS), *_ports(), "--model", str(model_dir), "--startup-timeout", "240"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    up_pid = None
    try:
        lines = _read_until(proc, "running; Ctrl-C to stop", timeout_s=300)
        head = "".join(lines)
        assert "running; Ctrl-C to stop" in head, head + _logs(tmp_path)
        up_pid = int(next(ln for ln in lines if ln.startswith("up-pid ")).split()[1])
        pids = [int(ln.split("pid ")[1].split(",")[0]) for ln in lines if ln.startswith("started")]
        assert len(pids) == 3, head
        os.kill(up_pid, sig)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:  # failed early: stop `up` (and so its children), then wait
            if up_pid is not None:
                os.kill(up_pid, signal.SIGTERM)
            proc.terminate()
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 128 + sig, head + out + _logs(tmp_path)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)


def test_dry_run_with_p_and_d_sharing_one_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--share-device: both engines on GPU 0, each with a fixed KV size and a utilization
    the second engine's start-up check can meet; refused off CUDA."""
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(cli.app, ["up", "--dry-run", "--hardware-backend", "cuda",
                                "--share-device", "30"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    for role in ("prefill", "decode"):
        cmd = lines[lines.index(next(x for x in lines if x.startswith(f"# {role}"))) + 1]
        assert "CUDA_VISIBLE_DEVICES=0 " in cmd
        assert f"--kv-cache-memory-bytes {30 << 30}" in cmd
        assert "--gpu-memory-utilization 0.4" in cmd
    bad = runner.invoke(cli.app, ["up", "--dry-run", "--share-device", "30"])
    assert bad.exit_code == 2 and "--hardware-backend cuda" in bad.output


def _engine_models(output: str) -> set[str]:
    """The --model each engine line of `up --dry-run` passes to vLLM."""
    models = set()
    for line in output.splitlines():
        words = shlex.split(line) if "vllm.entrypoints" in line else []
        if words:
            models.add(words[words.index("--model") + 1])
    return models


def test_up_passes_a_hub_id_to_vllm_as_an_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--model Qwen/Qwen3-0.6B` (no such local dir) reaches vLLM as the id; a local dir
    of the same shape wins and is passed absolute."""
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(cli.app, ["up", "--dry-run", "--model", "Qwen/Qwen3-0.6B"])
    assert r.exit_code == 0, r.output
    assert _engine_models(r.output) == {"Qwen/Qwen3-0.6B"}
    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)
    r = runner.invoke(cli.app, ["up", "--dry-run", "--model", "Qwen/Qwen3-0.6B"])
    assert _engine_models(r.output) == {str(tmp_path / "Qwen" / "Qwen3-0.6B")}


@pytest.mark.parametrize("model", ["./models/missing", "/no/such/model", "a/b/c", "~/nope"])
@pytest.mark.parametrize("dry_run", [True, False])
def test_up_refuses_a_missing_local_model_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str, dry_run: bool) -> None:
    """A --model that is neither a directory nor a hub id: exit 2 and one line naming it,
    before any process starts (engine_argv is never asked)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    asked: list[EngineSpec] = []
    monkeypatch.setattr(up_stack, "engine_argv", lambda spec: asked.append(spec) or [])
    r = runner.invoke(cli.app, ["up", "--model", model, *(["--dry-run"] if dry_run else []),
                                *_ports()])
    assert r.exit_code == 2 and not asked
    (line,) = r.output.splitlines()
    assert model in line
    (tmp_path / "file").write_text("")
    r = runner.invoke(cli.app, ["up", "--model", str(tmp_path / "file"), "--dry-run"])
    assert r.exit_code == 2 and len(r.output.splitlines()) == 1 and not asked
