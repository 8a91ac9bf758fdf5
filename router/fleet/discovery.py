"""The router's view of a changing fleet: discovery (an engines file) and health.

Discovery: `engines_file` is a JSON object listing engines by role; it is re-read every
`discovery_interval_s` and applied when its content changed (an unreadable or invalid
file keeps the last good list, so a half-written file never empties the pools)::

    {"prefill": ["http://p0:8100", {"url": "http://p1:8100", "kv_addr": "p1:5600"}],
     "decode":  [{"url": "http://d0:8200", "control_addr": "d0:5700"}]}

DNS: each `name:port` of `prefill_dns` / `decode_dns` is resolved every `dns_interval_s`;
every address is one engine (`http://addr:port`, its side channel or lease control on the
role's fixed port). A Kubernetes headless Service answers one A record per ready pod, and
no record at all (NXDOMAIN) when none is ready: that empties the role's DNS engines. A
lookup that fails otherwise (no DNS server, a timeout) keeps the last answer.

Discovered engines (file and DNS) join the static ones. An engine that appears starts
getting work at once; one that vanishes gets no new work, and turns of conversations whose
KV was on it recompute (`flow` only offers P an entry whose D is still usable).

Health: every `health_interval_s` each engine's `/health` is probed; failures (probes,
and requests that failed on the wire or with 5xx, counted by `flow`) eject an engine after
`eject_after` in a row, and a probe answered 200 re-admits it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
from pathlib import Path
from typing import Any

import httpx

from ..metrics import RouterMetrics
from ..settings import EngineInfo, RouterSettings, check_url, parse_addr
from .upstreams import UpstreamPool

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


def parse_engines(data: Any) -> dict[str, EngineInfo]:
    """url -> EngineInfo from the engines file's JSON; ValueError on anything malformed."""
    if not isinstance(data, dict) or not set(data) <= set(ROLES):
        raise ValueError(f"engines file must be an object with keys {ROLES}")
    out: dict[str, EngineInfo] = {}
    for role in ROLES:
        items = data.get(role, [])
        if not isinstance(items, list):
            raise ValueError(f"{role}: expected a list")
        for item in items:
            spec = {"url": item} if isinstance(item, str) else item
            if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
                raise ValueError(f"{role}: each engine is a URL or an object with a url")
            for addr in ("kv_addr", "control_addr"):
                if spec.get(addr) is not None:
                    parse_addr(str(spec[addr]))
            url = check_url(spec["url"])
            out[url] = EngineInfo(role, url, spec.get("kv_addr"), spec.get("engine_id"),
                                  spec.get("control_addr"))
    return out


class Fleet:
    """Keeps the two pools in line with discovery and health; runs as background tasks."""

    def __init__(self, settings: RouterSettings, prefill: UpstreamPool, decode: UpstreamPool,
                 metrics: RouterMetrics) -> None:
        self.settings = settings
        self.pools = {"prefill": prefill, "decode": decode}
        self.metrics = metrics
        self.static = {"prefill": list(settings.prefill_urls), "decode": list(settings.decode_urls)}
        self._last_text: str | None = None
        self.discovered: dict[str, EngineInfo] = {}
        self.reloads = 0  # applied engine-file versions (tests wait on it)
        self.invalid = 0  # versions refused as invalid
        self.probes = 0  # completed probe rounds
        self._from_file: dict[str, EngineInfo] = {}
        self._from_dns: dict[str, EngineInfo] = {}
        self._dns_last: dict[str, list[str]] = {}  # name -> addresses of its last answer
        self.dns_rounds = 0  # completed DNS rounds (tests wait on it)
        self.getaddrinfo: Any = None  # the resolver; None: the event loop's (the system's)

    # -- discovery ---------------------------------------------------------------------
    def reload(self) -> bool:
        """Apply the engines file if it changed; True if it was applied."""
        path = self.settings.engines_file
        if not path:
            return False
        try:
            text = Path(path).read_text()
        except OSError as exc:
            if self._last_text is not None:
                log.warning("engines file %s unreadable (%s); keeping the last engines", path, exc)
            return False
        if text == self._last_text:
            return False
        self._last_text = text
        try:
            engines = parse_engines(json.loads(text))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            self.invalid += 1
            log.warning("engines file %s is invalid (%s); keeping the last engines", path, exc)
            return False
        self._from_file = engines
        self.apply({**self._from_dns, **engines})
        return True

    async def resolve_dns(self) -> None:
        """One round of DNS discovery; applies the engines when the answers changed."""
        resolve = self.getaddrinfo or asyncio.get_running_loop().getaddrinfo
        found: dict[str, EngineInfo] = {}
        changed = False
        for role, names in (("prefill", self.settings.prefill_dns),
                            ("decode", self.settings.decode_dns)):
            for name in names:
                host, port = parse_addr(name)
                try:
                    infos = await asyncio.wait_for(
                        resolve(host, port, type=socket.SOCK_STREAM),
                        timeout=max(self.settings.dns_interval_s, 1.0))
                    addrs = sorted({str(i[4][0]) for i in infos})
                except socket.gaierror as exc:
                    if exc.errno != socket.EAI_NONAME:  # not "no such name": keep the last
                        log.warning("DNS %s: %s; keeping its last engines", name, exc)
                        addrs = self._dns_last.get(name, [])
                    else:
                        addrs = []
                except (TimeoutError, OSError) as exc:
                    log.warning("DNS %s: %s; keeping its last engines", name, exc)
                    addrs = self._dns_last.get(name, [])
                changed |= addrs != self._dns_last.get(name)
                self._dns_last[name] = addrs
                for a in addrs:
                    found.update([self._dns_engine(role, a, port)])
        self.dns_rounds += 1
        if changed:
            self._from_dns = found
            self.apply({**found, **self._from_file})

    def _dns_engine(self, role: str, addr: str, http_port: int) -> tuple[str, EngineInfo]:
        host = f"[{addr}]" if ipaddress.ip_address(addr).version == 6 else addr
        url = f"http://{host}:{http_port}"
        kv = self.settings.prefill_kv_port if role == "prefill" else None
        ctl = self.settings.decode_control_port if role == "decode" else None
        return url, EngineInfo(role, url,  # type: ignore[arg-type]
                               kv_addr=f"{host}:{kv}" if kv else None,
                               control_addr=f"{host}:{ctl}" if ctl else None)

    async def watch_dns(self) -> None:
        while True:
            await self.resolve_dns()
            await asyncio.sleep(self.settings.dns_interval_s)

    def apply(self, engines: dict[str, EngineInfo]) -> None:
        self.discovered = engines
        self.settings.set_discovered(engines)
        for role, pool in self.pools.items():
            urls = self.static[role] + [u for u, e in engines.items()
                                        if e.role == role and u not in self.static[role]]
            added, removed = pool.set_urls(urls)
            for change, urls_ in (("added", added), ("removed", removed)):
                if urls_:
                    self.metrics.discovery_changes.labels(role=role, change=change).inc(len(urls_))
                    log.info("discovery: %s %s %s", role, change, ", ".join(urls_))
        self.reloads += 1

    async def watch(self) -> None:
        while True:
            self.reload()
            await asyncio.sleep(self.settings.discovery_interval_s)

    # -- health --------------------------------------------------------------------------
    async def probe_all(self, client: httpx.AsyncClient) -> None:
        """One round of /health probes of every engine."""
        timeout = httpx.Timeout(min(self.settings.connect_timeout_s, 2.0))

        async def probe(pool: UpstreamPool, up: Any) -> None:
            try:
                r = await client.get(up.url + "/health", timeout=timeout)
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                if pool.answered(up):
                    log.info("%s %s answers /health again: re-admitted", pool.role, up.url)
            elif pool.failed(up):
                log.warning("%s %s ejected after %d failures", pool.role, up.url, up.failures)

        await asyncio.gather(*(probe(pool, up) for pool in self.pools.values()
                               for up in list(pool.upstreams)))
        self.probes += 1

    async def probe_loop(self, client: httpx.AsyncClient) -> None:
        while True:
            await self.probe_all(client)
            await asyncio.sleep(self.settings.health_interval_s)
