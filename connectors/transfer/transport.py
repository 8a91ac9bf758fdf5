"""The only module that calls NIXL.

One `Transport` per engine rank: an agent with the configured backends, the rank's KV
regions registered once, peers added from their handshake metadata, and READ/WRITE of
block lists whose contiguous runs are merged into single descriptors before submission
(NIXL is handed few large descriptors, not one per block). Not thread-safe by design:
exactly one thread (the connector's transfer thread) owns a Transport.

LIBFABRIC (trn2/EFA), where NIXL 1.5.1 behaves unlike UCX (tests/test_libfabric_*.py, run
over libfabric's tcp provider with FI_PROVIDER=tcp, ofiwg/libfabric man/fabric.7.md;
trn2 uses efa): its plugin needs a libfabric exporting FABRIC_1.10, libcuda.so.1,
libcudart.so.N and libhwloc.so.15, and tcp a non-loopback interface
(kvferry.neuron.envcheck says what is missing). A READ's notification is sent by the
reader's own check_xfer_state once the READ is complete (UCX's progress thread sends it
unpolled): `poll` is that call. A WRITE's DONE only frees its source; the target's bytes
are complete when its notification arrives there (what the push path acts on).
Completions wait for the next poll of the plugin's progress thread, which sleeps
``progress_delay_us`` between idle polls. add_remote_agent blocks while the peer is
unreachable (``add_peer_timeout_s`` bounds it). A peer dying mid-transfer makes it ERR,
but a transfer posted to a peer that died idle never ends, and from then on no transfer
of this agent completes (the plugin retries -FI_EAGAIN forever): deadlines end each one,
an engine restart clears it. No registration limit was met on tcp (4096 regions, a 3 GiB
region), and lists of 4096 descriptors (4x the plugin's per-rail request pool) complete.
"""

from __future__ import annotations

import gc
import logging
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from kvferry.connectors.memory.backends import KVLayout
from kvferry.connectors.protocol.tp_map import Segment
from kvferry.connectors.transfer import faults
from kvferry.connectors.transfer.backend_settings import ucx_defaults
from kvferry.connectors.transfer.layout import (
    check_compatible,
    check_head_compatible,
    descriptors,
    head_descriptors,
)

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers


class TransferError(RuntimeError):
    """A NIXL operation failed; callers fall back to recomputation or fail the request."""


@dataclass
class Peer:
    """A remote rank's NIXL agent as loaded into ours, and its KV layout."""

    agent_name: str
    layout: KVLayout


class XferState(StrEnum):
    """A transfer's state, as NIXL reports it for each request."""

    PROC = "PROC"  # still running
    DONE = "DONE"
    ERR = "ERR"


@dataclass
class Transfer:
    """One READ or WRITE posted to NIXL (several handles when split across lanes)."""

    handles: list
    peer: str
    nbytes: int
    ndesc: int
    state: XferState = XferState.PROC
    notif_after: bytes = b""  # sent once every lane is done (multi-lane READs)


_AGENT_LOCK = threading.Lock()

FENCE_S = 10.0
"""How long a transfer fenced past its deadline (`Transport.drop_agent`) may still be
reported running before its caller gives up on hearing its end (``transfers_unfenced``)."""


def combined(states: Sequence[XferState]) -> XferState:
    """One state for several requests: ERR if any failed, PROC while any runs, else DONE."""
    if XferState.ERR in states:
        return XferState.ERR
    return XferState.PROC if XferState.PROC in states else XferState.DONE


def make_agent(name: str, backends: Sequence[str], progress_delay_us: int):
    """A NIXL agent with ``backends`` whose progress thread waits up to
    ``progress_delay_us`` for events (0: nixl's own busy-polling thread)."""
    import nixl._api as api  # lazy: heavy native import

    ucx_defaults()
    conf = api.nixl_agent_config(backends=list(backends))
    if progress_delay_us <= 0:
        return api.nixl_agent(name, conf)
    return _agent_with_progress_delay(api, name, conf, progress_delay_us)


def _agent_with_progress_delay(api, name: str, conf, progress_delay_us: int):  # noqa: ANN001
    """``api.nixl_agent(name, conf)`` with the bound agent config's ``pthrDelay`` set.

    Why a monkeypatch: nixl's Python wrapper (1.5.x) builds its agent config with
    ``pthrDelay = 0``, which makes each agent's progress thread poll in a tight loop: one
    core per engine rank, spent even when idle (two engines on a 2-core host starve each
    other). The UCX progress thread sleeps on the workers' event fds, so a delay only
    bounds how long an idle wait lasts; events still wake it at once. The wrapper offers
    no knob, so its binding's agent constructor (``nixlBind.nixlAgent``) is replaced for
    the duration of this one construction, under a lock (agents of several ranks may be
    built at once), and always restored. A nixl without that binding gets its default.
    """
    bind = getattr(api, "nixlBind", None)
    real = getattr(bind, "nixlAgent", None)
    if real is None:
        return api.nixl_agent(name, conf)

    def agent_with_delay(agent_name, cfg):  # noqa: ANN001, ANN202
        cfg.pthrDelay = progress_delay_us
        return real(agent_name, cfg)

    with _AGENT_LOCK:
        bind.nixlAgent = agent_with_delay
        try:
            return api.nixl_agent(name, conf)
        finally:
            bind.nixlAgent = real


class Transport:
    """One engine rank's NIXL agent: its KV registered once, peers added from their
    handshake, block lists READ or written as merged descriptors. Owned by one thread."""

    def __init__(self, layout: KVLayout, backends: Sequence[str] = ("UCX",), name: str | None = None,
                 progress_delay_us: int = 1000, add_peer_timeout_s: float | None = None):
        self.layout = layout
        self.add_peer_timeout_s = add_peer_timeout_s
        self.name = name or f"kvferry-{uuid.uuid4().hex[:12]}"
        self.backends = list(backends)
        self.agent = make_agent(self.name, self.backends, progress_delay_us)
        missing = [b for b in self.backends if b not in self.agent.backends]
        if missing:
            raise TransferError(
                f"NIXL backend(s) {missing} unavailable (plugins: {self.agent.get_plugin_list()})"
            )
        self._peers: dict[str, Peer] = {}
        self._reg = None
        self._pool_reg = None
        if layout.regions:
            mem_types = {r.mem_type for r in layout.regions}
            if len(mem_types) != 1:
                raise ValueError(f"mixed memory types in one layout: {mem_types}")
            regs = [(r.addr, r.length, r.device_id, "") for r in layout.regions]
            self._reg = self.agent.register_memory(regs, mem_types.pop(), backends=self.backends)
        self.mem_type = layout.regions[0].mem_type if layout.regions else "DRAM"

    # -- peers -------------------------------------------------------------------------
    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, key: str, agent_metadata: bytes, layout: KVLayout) -> Peer:
        """Add (or refresh) a remote agent; refuses layouts we cannot copy block-for-block
        (same heads per rank) or head segment by head segment (different TP sizes)."""
        if faults.ACTIVE: faults.fail("peer_add")  # noqa: E701 (test-only hook, faults.py)
        if layout.num_heads == self.layout.num_heads:
            check_compatible(self.layout, layout)
        else:
            check_head_compatible(self.layout, layout)
        if key in self._peers:
            self.drop_peer(key)
        name = self._add_remote_agent(agent_metadata)
        if isinstance(name, bytes):
            name = name.decode()
        peer = Peer(name, layout)
        self._peers[key] = peer
        return peer

    def _add_remote_agent(self, agent_metadata: bytes) -> str | bytes:
        """NIXL's add_remote_agent, given up on after ``add_peer_timeout_s``: LIBFABRIC's
        blocks as long as the peer is unreachable (see the module docstring). The call
        stays blocked in its own thread; the agent keeps serving every other peer."""
        if self.add_peer_timeout_s is None:
            return self.agent.add_remote_agent(agent_metadata)
        out: list = []

        def add() -> None:
            try:
                out.append(self.agent.add_remote_agent(agent_metadata))
            except Exception as e:
                out.append(e)

        t = threading.Thread(target=add, name=f"{self.name}-add-peer", daemon=True)
        t.start()
        t.join(self.add_peer_timeout_s)
        if not out:
            raise TransferError(f"adding a remote agent did not finish within "
                                f"{self.add_peer_timeout_s}s (peer unreachable?)")
        if isinstance(out[0], Exception):
            raise out[0]
        return out[0]

    def add_pool(self, pool: KVLayout) -> Peer:
        """This rank's host pool (memory/host_pool.py), registered once, as a peer of its
        own agent: a WRITE to it copies KV blocks into slots, a READ from it copies them
        back. NIXL needs no metadata for its own agent (loadRemoteMD refuses it)."""
        check_compatible(self.layout, pool)
        if self._pool_reg is not None:
            raise TransferError("this rank has a host pool already")
        regs = [(r.addr, r.length, r.device_id, "") for r in pool.regions]
        self._pool_reg = self.agent.register_memory(regs, pool.regions[0].mem_type,
                                                    backends=self.backends)
        return Peer(self.name, pool)

    @staticmethod
    def pool_of(peer: Peer, pool: KVLayout) -> Peer:
        """A peer's host pool (its handshake's pool layout) as something to READ from: the
        same remote agent, the pool's addresses, slots shaped like that rank's blocks."""
        check_compatible(peer.layout, pool)
        return Peer(peer.agent_name, pool)

    def peer(self, key: str) -> Peer | None:
        return self._peers.get(key)

    def known_peers(self) -> dict[str, Peer]:
        """Every key a peer is known by (several keys may share one remote agent)."""
        return dict(self._peers)

    def alias(self, key: str, existing: str) -> Peer:
        """Reach the peer known as ``existing`` under ``key`` too, without loading its
        metadata again: NIXL re-registering a remote agent invalidates every transfer in
        flight to it (seen as NIXL_ERR_NOT_FOUND, "invalidated or re-registered")."""
        peer = self._peers[existing]
        old = self._peers.get(key)
        if old is not None and old is not peer and all(
                p is not old for k, p in self._peers.items() if k != key):
            self._forget(old)
        self._peers[key] = peer
        return peer

    def drop_peer(self, key: str) -> None:
        """Forget a peer under every key it is known by (it will be met afresh)."""
        peer = self._peers.pop(key, None)
        if peer is not None:
            for k in [k for k, p in self._peers.items() if p is peer]:
                del self._peers[k]
            self._forget(peer)

    def drop_agent(self, agent_name: str) -> None:
        """`drop_peer` by remote agent name: the fence for a transfer past its deadline.
        Removing the agent ends what NIXL has in flight to it (UCX closes the endpoint and
        its outstanding operations complete with an error; a handle's release alone may not
        recall an RMA already posted), so a poll then reports it ended (`FENCE_S`)."""
        for key, p in list(self._peers.items()):
            if p.agent_name == agent_name:
                self.drop_peer(key)
                return

    def _forget(self, peer: Peer) -> None:
        try:
            self.agent.remove_remote_agent(peer.agent_name)
        except Exception as e:  # peer may be half-gone already
            log.debug("remove_remote_agent(%s): %s", peer.agent_name, e)

    # -- transfers -----------------------------------------------------------------------
    def start(self, op: str, peer: Peer, local_ids: Sequence[int], remote_ids: Sequence[int],
              notif: bytes = b"", merge: bool = True, lanes: int = 1,
              seg: tuple[Sequence[Segment], bool] | None = None,
              planes: Sequence[int] | None = None) -> Transfer:
        """Post a READ (remote -> local) or WRITE (local -> remote) of whole blocks, or,
        with ``seg`` = (segments, local side is the source), of those segments of heads
        of each block (peers of different TP sizes, tp_map.plan), in one transfer.

        ``lanes`` > 1 splits a READ's descriptors into that many concurrently posted
        requests (more copy engines / streams in flight); its notification then goes out
        once all lanes are done. WRITEs keep one request so the notification is ordered
        after the data by NIXL itself. ``planes``: only these plane indices (one model
        layer's, for a layer-wise WRITE; default all).
        """
        if faults.ACTIVE: faults.fail("post")  # noqa: E701 (test-only hook, faults.py)
        if seg is None:
            loc, rem = descriptors(self.layout, peer.layout, local_ids, remote_ids, merge,
                                   planes)
        else:
            parts = [head_descriptors(self.layout, peer.layout, local_ids, remote_ids, s, seg[1],
                                      planes) for s in seg[0]]
            loc = np.concatenate([p[0] for p in parts]).reshape(-1, 3)
            rem = np.concatenate([p[1] for p in parts]).reshape(-1, 3)
        nbytes = int(loc[:, 1].sum()) if len(loc) else 0
        if not len(loc):  # nothing to move: still deliver the notification
            if notif:
                self.agent.send_notif(peer.agent_name, notif)
            return Transfer([], peer.agent_name, 0, 0, XferState.DONE)
        lanes = max(1, min(lanes if op == "READ" else 1, len(loc)))
        xfer = Transfer([], peer.agent_name, nbytes, len(loc), XferState.PROC,
                        notif if lanes > 1 else b"")
        try:
            for lo, re in zip(np.array_split(loc, lanes), np.array_split(rem, lanes), strict=True):
                ldl = self.agent.get_xfer_descs(lo, self.mem_type)
                rdl = self.agent.get_xfer_descs(re, peer.layout.regions[0].mem_type)
                handle = self.agent.initialize_xfer(op, ldl, rdl, peer.agent_name,
                                                    b"" if lanes > 1 else notif)
                xfer.handles.append(handle)
                if self.agent.transfer(handle) == XferState.ERR:
                    raise TransferError("posting returned ERR")
        except Exception as e:
            self.release(xfer)
            raise TransferError(f"{op} to {peer.agent_name} failed to post: {e}") from e
        return xfer

    def poll(self, xfer: Transfer) -> XferState:
        """The transfer's state; releases the NIXL handles once it ended."""
        if xfer.state != XferState.PROC:
            return xfer.state
        states = []
        for h in xfer.handles:
            try:
                states.append(XferState(self.agent.check_xfer_state(h)))
            except Exception as e:  # an unknown state string too: never PROC forever
                log.warning("transfer to %s: %s", xfer.peer, e)
                states.append(XferState.ERR)
        xfer.state = combined(states)
        xfer.state = faults.held(xfer, xfer.state) if faults.ACTIVE else xfer.state
        if xfer.state != XferState.PROC:
            self.release(xfer)
            if xfer.state == XferState.DONE and xfer.notif_after:
                self.agent.send_notif(xfer.peer, xfer.notif_after)
        return xfer.state

    def poll_all(self, xfers: Sequence[Transfer]) -> XferState:
        """`poll` every transfer of one request (one per peer rank), combined."""
        return combined([self.poll(x) for x in xfers])

    def release(self, xfer: Transfer) -> None:
        for h in xfer.handles:
            try:
                self.agent.release_xfer_handle(h)
            except Exception as e:  # an in-flight handle may refuse release; NIXL aborts it
                log.warning("release_xfer_handle: %s", e)
        xfer.handles = []

    # -- notifications ---------------------------------------------------------------------
    def notify(self, peer: Peer, msg: bytes) -> None:
        if faults.ACTIVE and faults.lost("notify"): return  # noqa: E701 (test-only hook)
        self.agent.send_notif(peer.agent_name, msg)

    def notifications(self) -> list[bytes]:
        out: list[bytes] = []
        for msgs in self.agent.get_new_notifs().values():
            out.extend(msgs)
        out = faults.kept("notif_in", out) if faults.ACTIVE else out  # test-only hook
        return out

    def close(self) -> None:
        """Forget peers, deregister, and drop the agent: its progress thread ends with it
        (an engine restarting its worker, or tests making many, would otherwise keep one
        thread per closed agent waking every ``progress_delay_us``)."""
        if self.agent is None:
            return
        for key in list(self._peers):
            self.drop_peer(key)
        for reg in (self._reg, self._pool_reg):
            if reg is None:
                continue
            try:
                self.agent.deregister_memory(reg, backends=self.backends)
            except Exception as e:
                log.debug("deregister_memory: %s", e)
        self._reg = self._pool_reg = None
        self.agent = None
        gc.collect()  # the wrapper's handles may hold it in a cycle
