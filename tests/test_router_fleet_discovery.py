"""Router fleet over real HTTP, discovery: engines from a discovery file and from DNS names,
added and removed as the answers change.

Fake engines (tests/helpers_http.py) answer like vLLM; D's lease offers come from a real
D-side LeaseKeeper whose lease-control server the routers call to release leases."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import helpers_router_fleet
import pytest
from fleet_stack import wait_for
from helpers_fleet import LeasingD, metric, reuse_of
from helpers_http import serve
from helpers_router_fleet import router, turn

from kvferry.router.settings import RouterSettings

_secret = helpers_router_fleet._secret
stack = helpers_router_fleet.stack
pd = helpers_router_fleet.pd


# -- 2. discovery -----------------------------------------------------------------------------
def test_discovery_file_adds_and_removes_engines(tmp_path: Path, pd, stack) -> None:
    p, d0, purl, d0url = pd
    d1 = LeasingD("d1")
    stack.callback(d1.server.close)
    d1url = stack.enter_context(serve(d1.engine.app()))
    engines = tmp_path / "engines.json"

    def publish(*ds: tuple[str, LeasingD]) -> None:
        tmp = engines.with_suffix(".tmp")
        tmp.write_text(json.dumps({"decode": [
            {"url": u, "control_addr": f"127.0.0.1:{x.control_port}"} for u, x in ds]}))
        tmp.replace(engines)

    publish((d0url, d0))
    url, app = router(stack, prefill_urls=[purl], decode_urls=[], engines_file=str(engines),
                      discovery_interval_s=0.05)
    fleet, pool = app.state.fleet, app.state.pools["decode"]
    assert [u.url for u in pool.upstreams] == [d0url]
    assert turn(url).status_code == 200 and len(d0.engine.received) == 1
    assert turn(url).status_code == 200 and reuse_of(p) is not None  # reuse on D0

    n = fleet.reloads
    publish((d1url, d1))  # D0 leaves, D1 arrives
    wait_for(lambda: fleet.reloads > n, what="engines file reloaded")
    assert [u.url for u in pool.upstreams] == [d1url]
    r = turn(url)
    assert r.status_code == 200 and r.headers["x-kvferry-decode"] == d1url
    assert reuse_of(p) is None  # its KV was on D0, gone: recompute, no error
    assert metric(app, "kvferry_router_stale_conversations_total") == 1
    assert len(d0.engine.received) == 2 and len(d1.engine.received) == 1
    assert turn(url).status_code == 200 and reuse_of(p)["engine_id"] == "d1-engine"

    n = fleet.reloads
    publish((d0url, d0), (d1url, d1))
    wait_for(lambda: fleet.reloads > n, what="engines file reloaded")
    for cid in ("x1", "x2", "x3", "x4"):
        assert turn(url, cid).status_code == 200
    assert len(d0.engine.received) > 2  # the newcomer gets work
    assert metric(app, "kvferry_router_discovery_changes_total", role="decode", change="added") == 3
    assert metric(app, "kvferry_router_discovery_changes_total", role="decode",
                  change="removed") == 1
    assert metric(app, "kvferry_router_upstreams", role="decode") == 2

    engines.write_text("{not json")  # a broken file keeps the last engines
    wait_for(lambda: fleet.invalid == 1, what="broken file read")
    assert turn(url, "x5").status_code == 200 and len(pool.upstreams) == 2


def test_dns_discovery_follows_the_names_answers(pd, stack) -> None:
    """Engines found by DNS names, as a Kubernetes headless Service publishes them: real
    lookups of `localhost`, and a test zone over the real resolver for the name whose
    answer changes (no DNS server here): NXDOMAIN empties it, a failed lookup keeps it."""
    p, d0, purl, d0url = pd
    pport, dport = int(purl.rsplit(":", 1)[1]), int(d0url.rsplit(":", 1)[1])
    url, app = router(stack, prefill_urls=[], decode_urls=[],
                      prefill_dns=[f"localhost:{pport}"], decode_dns=[f"decode.test:{dport}"],
                      prefill_kv_port=5655, decode_control_port=d0.control_port,
                      dns_interval_s=0.05)
    fleet, pools = app.state.fleet, app.state.pools
    zone = {"answer": "up"}
    real = fleet.getaddrinfo

    async def resolve(host: str, port: int, **kw: Any) -> Any:
        if host == "decode.test":
            if zone["answer"] == "nxdomain":
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            if zone["answer"] == "servfail":
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            host = "localhost"
        return await (real or asyncio.get_running_loop().getaddrinfo)(host, port, **kw)

    fleet.getaddrinfo = resolve

    def rounds_after(n: int) -> None:
        wait_for(lambda: fleet.dns_rounds > n + 1, what="DNS rounds")

    rounds_after(fleet.dns_rounds)
    assert [u.url for u in pools["prefill"].upstreams] == [purl]
    assert [u.url for u in pools["decode"].upstreams] == [d0url]
    assert app.state.settings.prefill_kv_addr(purl) == ("127.0.0.1", 5655)
    assert turn(url).status_code == 200
    assert turn(url).status_code == 200 and reuse_of(p)["engine_id"] == "d0-engine"

    zone["answer"] = "servfail"  # the resolver is down: keep what it said last
    rounds_after(fleet.dns_rounds)
    assert [u.url for u in pools["decode"].upstreams] == [d0url]

    zone["answer"] = "nxdomain"  # no ready pod behind the Service: no engine
    rounds_after(fleet.dns_rounds)
    assert pools["decode"].upstreams == []
    assert metric(app, "kvferry_router_discovery_changes_total", role="decode",
                  change="removed") == 1

    zone["answer"] = "up"  # the pod is back: it gets work, its conversations recompute
    rounds_after(fleet.dns_rounds)
    assert [u.url for u in pools["decode"].upstreams] == [d0url]
    assert turn(url, "c2").status_code == 200


def test_dns_names_alone_are_a_valid_configuration() -> None:
    s = RouterSettings(prefill_urls=[], decode_urls=[], prefill_dns=["p.svc:8100"],
                       decode_dns=["d.svc:8200"])
    assert s.discovers
    with pytest.raises(ValueError, match="host:port"):
        RouterSettings(prefill_urls=[], decode_urls=[], prefill_dns=["p.svc"])
