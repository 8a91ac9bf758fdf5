"""Worker-side transfers, on one background thread per engine rank.

The engine loop only hands tasks over (`submit`) and collects results (`results`); the
handshake, descriptor building, NIXL posting and polling all happen on the transfer
thread, so a slow or dead peer never stalls token generation.

P side: blocks of a finished prefill wait until D's completion notification (or a
timeout) and are then reported as finished-sending, which frees them in vLLM.
D side: each READ ends as finished-receiving; a failed or timed-out READ also reports
its local block ids as load errors, so vLLM recomputes (or fails, per policy).

Host staging (Neuron without device registration): the layout is a pinned DRAM mirror
of the device KV and ``staging`` copies between the two. What arrives (a READ here, a
push WRITE) reaches the device before it is reported received; what leaves is copied out
before a peer can read it: a push WRITE right before posting, a pull offer's blocks by
`save` on the engine thread. Without staging (cpu, cuda, Neuron device mode) none of
this runs.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvferry.connectors.config import BUSY_POLL_S, IDLE_POLL_S, ConnectorConfig
from kvferry.connectors.memory.backends import KVLayout
from kvferry.connectors.protocol import messages
from kvferry.connectors.protocol.tp_map import by_rank, notified_by, plan
from kvferry.connectors.scheduling.scheduler import PushSend, RecvTask, ReuseRead, StepMeta
from kvferry.connectors.transfer.handshake import HandshakeError, HandshakeServer, fetch
from kvferry.connectors.transfer.push_worker import PushEndpoint, Ready
from kvferry.connectors.transfer.transport import Peer, Transfer, Transport

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers


class Staging(Protocol):
    """Host staging as the worker uses it (kvferry.neuron.staging.HostStaging)."""

    def stage_out(self, block_ids: Iterable[int]) -> Any: ...
    def stage_in(self, block_ids: Iterable[int]) -> Any: ...


@dataclass
class _Results:
    sent: set[str] = field(default_factory=set)
    recvd: set[str] = field(default_factory=set)
    bad_blocks: set[int] = field(default_factory=set)

    def any(self) -> bool:
        return bool(self.sent or self.recvd or self.bad_blocks)


@dataclass
class _Read:
    task: RecvTask | ReuseRead
    xfers: list[Transfer]  # one per P rank segment when P's TP size differs from ours
    deadline: float
    started: float
    peer_keys: list[str]
    strict: bool = False  # a READ that ends after its deadline counts as failed
    notices: list[tuple[Peer, bytes]] = field(default_factory=list)  # sent once all are done
    release: list[tuple[Peer, bytes]] = field(default_factory=list)  # pull: P's Done, also on failure


class TransferWorker:
    def __init__(self, cfg: ConnectorConfig, engine_id: str, rank: int, layout: KVLayout,
                 nixl_backends: list[str] | None = None, instance: str = "",
                 staging: Staging | None = None, tp_size: int = 1, num_heads: int = 0):
        self.cfg = cfg
        self.tp_size = tp_size
        self.num_heads = num_heads  # the model's KV heads (all ranks); 0: unknown
        self.staging = staging  # None: KV moves straight from/to the registered layout
        self.engine_id = engine_id
        self.rank = rank
        self.instance = instance
        self.transport = Transport(layout, nixl_backends or cfg.transport_backends(),
                                   name=f"kvferry-{engine_id}-r{rank}",
                                   progress_delay_us=cfg.nixl_progress_delay_us)
        self._server = HandshakeServer(cfg.side_channel_host, cfg.side_channel_port + rank, {
            "engine_id": engine_id, "rank": rank, "tp_size": tp_size, "instance": instance,
            "metadata": self.transport.metadata(), "layout": layout.to_wire(),
        })
        self._inbox: queue.Queue[StepMeta | Ready] = queue.Queue()
        self.steps = 0  # engine steps begun (set by the engine thread)
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # signalled by report()
        self._out = _Results()
        self._stop = threading.Event()
        # transfer-thread state
        self._reads: dict[str, _Read] = {}
        self._send_wait: dict[str, float] = {}
        self._early: dict[str, float] = {}
        self._dones: dict[str, tuple[int, float]] = {}  # P: notices so far, until when kept
        self._addr_engine: dict[str, str] = {}
        self._instances: dict[str, str] = {}  # peer key -> the peer's boot id
        self._tp: dict[str, int] = {}  # peer key -> the peer engine's TP size
        self.push = PushEndpoint(self)
        self._thread = threading.Thread(target=self._run, name=f"kvferry-xfer-r{rank}", daemon=True)
        self._thread.start()
        log.info("kvferry worker %s rank %d: %d regions, %d planes, side channel %s%s",
                 engine_id, rank, len(layout.regions), len(layout.planes), self._server.address,
                 "; KV staged through host DRAM" if staging is not None else "")

    # -- engine thread -----------------------------------------------------------------
    def submit(self, meta: StepMeta, step: int = 0) -> None:
        """A step's metadata, at the step's start. ``step`` counts the engine's steps: an
        early push waits until the step after its forward has begun (the meta is queued
        first, so whatever that step says about the request is seen before the WRITE)."""
        if meta.recv or meta.send or meta.reuse or meta.free or meta.has_push():
            self._inbox.put(meta)
        self.steps = max(self.steps, step)

    def forward_done(self, items: Sequence[PushSend], fence: Any, step: int) -> None:
        """Early push, after step ``step``'s forward was enqueued: these prompts are
        complete once ``fence`` passes (None: already)."""
        self._inbox.put(Ready(list(items), fence, step))

    def save(self, block_ids: Sequence[int]) -> None:
        """Engine thread, after the forward: copy these blocks device -> host mirror.

        Raises on failure: the offer for these blocks is about to be published and D would
        READ a stale mirror, a wrong answer; failing the step is the honest outcome.
        """
        if self.staging is not None and block_ids:
            self.staging.stage_out(block_ids)

    def stage_in(self, req_id: str, block_ids: Sequence[int]) -> bool:
        """Transfer thread: blocks that landed in the host mirror -> device, before they
        are reported received. False (logged) if the copy failed: report them bad."""
        if self.staging is None or not block_ids:
            return True
        try:
            self.staging.stage_in(block_ids)
        except Exception as e:
            log.warning("request %s: host -> device copy of %d blocks failed (%s); recomputing",
                        req_id, len(block_ids), e)
            return False
        return True

    def stage_out(self, block_ids: Sequence[int]) -> None:
        """Transfer thread: device -> host mirror before our WRITE reads it (push, P)."""
        if self.staging is not None and block_ids:
            self.staging.stage_out(block_ids)

    def results(self, wait_s: float = 0.0) -> _Results:
        """Everything reported since the last call; with ``wait_s``, first wait up to that
        long for something to be reported (an engine step with nothing to compute)."""
        with self._ready:
            if wait_s > 0 and not self._out.any():
                self._ready.wait(wait_s)
            out, self._out = self._out, _Results()
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._server.close()
        self.transport.close()

    # -- transfer thread ---------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with contextlib.suppress(queue.Empty):
                    self._take(self._inbox.get(timeout=self._poll_s()))
                self._progress()
            except Exception:  # never let the thread die: requests would hang
                log.exception("kvferry transfer thread")

    def _take(self, item: StepMeta | Ready) -> None:
        if isinstance(item, Ready):
            self.push.ready(item)
        else:
            self._accept(item)

    def drain_inbox(self) -> None:
        """Transfer thread: act on everything queued so far."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._take(item)

    def _poll_s(self) -> float:
        """How long the thread may sleep before it next polls transfers and notifications."""
        cfg = self.cfg
        if self._reads or self.push.busy():
            return BUSY_POLL_S
        return cfg.notif_poll_s if self.push.awaiting() else IDLE_POLL_S

    def _accept(self, meta: StepMeta) -> None:
        now = time.monotonic()
        for req_id in meta.send:
            if self._early.pop(req_id, None) is not None:
                self.report(sent={req_id})
            else:
                self._send_wait[req_id] = now + self.cfg.send_timeout_s
        for task in meta.recv:
            self._start_read(task, now)
        for rr in meta.reuse:
            self._start_reuse(rr, now)
        if meta.free:  # D: leases ended; vLLM frees these requests' blocks
            self.report(sent=set(meta.free))
        self.push.accept(meta, now)

    def peer_at(self, host: str, port: int, engine_id: str | None = None,
                rank: int | None = None) -> tuple[str, Peer]:
        """(engine id, peer) for TP rank ``rank`` (default: ours) of the engine at
        host:port (cached).

        ``engine_id`` (when the caller knows it) must match what the side channel says.
        """
        rank = self.rank if rank is None else rank
        key = f"{engine_id}/{rank}" if engine_id else f"{host}:{port}/{rank}"
        peer = self.transport.peer(key)
        if peer is not None:
            return engine_id or self._addr_engine[key], peer
        info = fetch(host, port + rank, self.cfg.handshake_timeout_s)
        found = str(info.get("engine_id"))
        if engine_id and found != engine_id:
            raise HandshakeError(f"{host}:{port} is engine {found!r}, expected {engine_id!r}")
        # One NIXL remote agent per peer engine, whichever key found it first (push
        # registrations know an address, pull offers and reuse an engine id): loading its
        # metadata twice would invalidate the transfers in flight to it.
        if int(info.get("rank", rank)) != rank:
            raise HandshakeError(f"{host}:{port + rank} serves rank {info.get('rank')}, not {rank}")
        ekey, akey = f"{found}/{rank}", f"{host}:{port}/{rank}"
        instance = str(info.get("instance", ""))
        if self.transport.peer(ekey) is None or self._instances.get(ekey) != instance:
            self.transport.add_peer(ekey, info["metadata"], KVLayout.from_wire(info["layout"]))
        peer = self.transport.alias(akey, ekey)
        for k in (ekey, akey):
            self._addr_engine[k] = found
            self._instances[k] = instance
            self._tp[k] = int(info.get("tp_size", 1))
        return found, peer

    def peer_tp(self, host: str, port: int, engine_id: str | None = None) -> int:
        """TP size of the engine at host:port (asked of its rank 0, which every engine has)."""
        found, _ = self.peer_at(host, port, engine_id, 0)
        return self._tp.get(f"{found}/0", 1)

    def drop_peer(self, host: str, port: int, engine_id: str | None = None,
                  rank: int | None = None) -> None:
        rank = self.rank if rank is None else rank
        self.transport.drop_peer(f"{engine_id}/{rank}" if engine_id else f"{host}:{port}/{rank}")

    def _read_plan(self, src_tp: int, src: str) -> list[tuple[int, Any]]:
        """(source rank, ``seg`` for Transport.start) of every READ that fetches our heads:
        the same rank, whole blocks, when the TP sizes match; else one READ per source
        rank holding some of our heads, of those head segments (tp_map.plan)."""
        if src_tp == self.tp_size:
            return [(self.rank, None)]
        if self.num_heads <= 0:
            raise ValueError(f"{src} TP {src_tp} != ours {self.tp_size} and the model's KV "
                             "heads are unknown")
        return [(r, (segs, False)) for r, segs in
                by_rank(plan(self.num_heads, src_tp, self.tp_size, self.rank)).items()]

    def _release_plan(self, p_tp: int) -> dict[int, int]:
        """Pull: P rank -> how many D ranks' notices it waits for, for the P ranks we tell
        (tp_map.notified_by; just our own rank's peer when the TP sizes match)."""
        if p_tp == self.tp_size:
            return {self.rank: 1}
        if self.num_heads <= 0:
            raise ValueError(f"prefill TP {p_tp} != ours {self.tp_size} and the model's KV "
                             "heads are unknown")
        return notified_by(self.num_heads, p_tp, self.tp_size, self.rank)

    def _start_read(self, task: RecvTask, now: float) -> None:
        """D: READ our heads of the offered blocks (`_read_plan`), then tell every P rank
        of `_release_plan` that we are done. A single READ from the only rank to tell
        carries the notice itself (NIXL sends it after the data)."""
        o = task.offer
        keys = [f"{o.remote_engine_id}/{p}" for p in range(o.remote_tp_size)]
        xfers: list[Transfer] = []
        msgs: list[tuple[Peer, bytes]] = []
        try:
            notices = self._release_plan(o.remote_tp_size)
            pieces = [] if task.release_only else self._read_plan(o.remote_tp_size, "prefill")
            peers = {p: self.peer_at(o.remote_host, o.remote_port, o.remote_engine_id, p)[1]
                     for p in {*notices, *(r for r, _ in pieces)}}
            msgs = [(peers[p], messages.encode(messages.Done(o.remote_request_id, n)))
                    for p, n in notices.items()]
            if task.release_only:
                for peer, m in msgs:
                    self.transport.notify(peer, m)
                return
            budget = self._read_budget(task)
            attach = len(pieces) == 1 and list(notices) == [pieces[0][0]]
            for r, seg in pieces:
                xfers.append(self.transport.start("READ", peers[r], task.local_block_ids,
                                                  task.remote_block_ids,
                                                  msgs[0][1] if attach else b"", seg=seg))
        except Exception as e:  # any failure of one request must end in a recompute, not a hang
            for x in xfers:
                self.transport.release(x)
            if task.release_only:
                log.warning("could not tell %s to free %s: %s", o.remote_engine_id,
                            o.remote_request_id, e)
                return
            log.warning("request %s: READ from %s (TP %d -> %d) failed (%s); recomputing",
                        task.req_id, o.remote_engine_id, o.remote_tp_size, self.tp_size, e)
            for peer, m in msgs if not isinstance(e, ValueError | IndexError) else ():
                self._release(peer, m)  # nothing of ours reads P's blocks: P frees them now
            if not isinstance(e, ValueError | IndexError):
                for key in keys:  # re-handshake next time (P may restart)
                    self.transport.drop_peer(key)
            else:  # bad ids or an impossible split, good peers: let P free now
                for peer, m in msgs:
                    self._release(peer, m)
            self._fail(task)
            return
        self._reads[task.req_id] = _Read(task, xfers, now + budget, now, keys,
                                         strict=bool(o.expiry), notices=[] if attach else msgs)
        self._reads[task.req_id].release = msgs

    def _read_budget(self, task: RecvTask) -> float:
        budget = self.cfg.recv_timeout_s
        if task.offer.expiry:
            budget = min(budget, task.offer.expiry - time.time())
            if budget <= 0:
                raise ValueError("offer expired: P may have freed those blocks")
        return budget

    def _start_reuse(self, rr: ReuseRead, now: float) -> None:
        """P: READ D's leased blocks (from each D rank holding some of our heads when D
        has another TP size); any failure means recompute, never a wrong answer."""
        keys = [f"{rr.engine_id}/{r}" for r in range(rr.tp_size)]
        xfers: list[Transfer] = []
        try:
            pieces = self._read_plan(rr.tp_size, "decode")
            peers = {r: self._lease_peer(rr, r) for r in {r for r, _ in pieces}}
            budget = rr.deadline - time.time()
            if budget <= 0:
                raise TimeoutError("lease read deadline already passed")
            for r, seg in pieces:
                xfers.append(self.transport.start("READ", peers[r], rr.local_block_ids,
                                                  rr.remote_block_ids, seg=seg))
        except Exception as e:
            for x in xfers:
                self.transport.release(x)
            log.warning("request %s: reuse READ from %s not started (%s); recomputing",
                        rr.req_id, rr.engine_id, e)
            if not isinstance(e, ValueError | IndexError | TimeoutError):
                for key in keys:
                    self.transport.drop_peer(key)
            self.report(recvd={rr.req_id}, bad_blocks=rr.local_block_ids)
            return
        self._reads[rr.req_id] = _Read(rr, xfers, now + budget, now, keys, strict=True)

    def _lease_peer(self, rr: ReuseRead, rank: int) -> Peer:
        """D's rank ``rank``, met afresh if D restarted since (its leases are gone then)."""
        key = f"{rr.engine_id}/{rank}"
        _, peer = self.peer_at(rr.host, rr.port, rr.engine_id, rank)
        if self._instances.get(key) != rr.instance:
            self.drop_peer(rr.host, rr.port, rr.engine_id, rank)
            _, peer = self.peer_at(rr.host, rr.port, rr.engine_id, rank)
            if self._instances.get(key) != rr.instance:
                raise HandshakeError("the lease belongs to an earlier run of that engine")
        return peer

    def _progress(self) -> None:
        now = time.monotonic()
        for req_id, rd in list(self._reads.items()):
            state = self.transport.poll_all(rd.xfers)
            if state == "PROC" and now < rd.deadline:
                continue
            del self._reads[req_id]
            if state == "DONE" and not (rd.strict and now > rd.deadline):
                log.info("kvferry %s %s: %d blocks, %d B in %d descriptors, %.1f ms",
                         "reuse READ" if isinstance(rd.task, ReuseRead) else "READ", req_id,
                         len(rd.task.local_block_ids), sum(x.nbytes for x in rd.xfers),
                         sum(x.ndesc for x in rd.xfers), (now - rd.started) * 1e3)
                for peer, msg in rd.notices:
                    self._release(peer, msg)
                ok = self.stage_in(req_id, rd.task.local_block_ids)
                self.report(recvd={req_id}, bad_blocks=() if ok else rd.task.local_block_ids)
            else:
                log.warning("request %s: READ %s; recomputing", req_id,
                            "failed" if state == "ERR" else "timed out")
                for x in rd.xfers:
                    self.transport.release(x)
                for peer, msg in rd.release:  # READ aborted: P need not hold its blocks
                    self._release(peer, msg)
                for key in rd.peer_keys:
                    self.transport.drop_peer(key)
                self.report(recvd={req_id}, bad_blocks=rd.task.local_block_ids)
        for blob in self.transport.notifications():
            msg = messages.decode(blob)
            if isinstance(msg, messages.Done):
                self._on_done(msg, now)
            elif msg is not None:
                self.push.on_message(msg, now)
            else:
                log.warning("ignoring a notification that is not a kvferry message")
        self.push.progress(now)
        for req_id, deadline in list(self._send_wait.items()):
            if now >= deadline:
                log.warning("request %s: no decode read its KV within %.0fs; freeing",
                            req_id, self.cfg.send_timeout_s)
                del self._send_wait[req_id]
                self.report(sent={req_id})
        for req_id, deadline in list(self._early.items()):
            if now >= deadline:
                del self._early[req_id]
        for req_id, (_, deadline) in list(self._dones.items()):
            if now >= deadline:
                del self._dones[req_id]

    def _on_done(self, msg: messages.Done, now: float) -> None:
        """P: a D rank is done with ``msg.req_id``'s blocks; they go after the last one."""
        count = self._dones.pop(msg.req_id, (0, 0.0))[0] + 1
        if count < msg.expect:
            self._dones[msg.req_id] = (count, now + self.cfg.send_timeout_s)
        elif self._send_wait.pop(msg.req_id, None) is not None:
            self.report(sent={msg.req_id})
        else:
            self._early[msg.req_id] = now + self.cfg.send_timeout_s

    def notify(self, peer: Peer, msg: messages.Message) -> None:
        """Best effort: every protocol step has a timeout behind a lost message."""
        self._release(peer, messages.encode(msg))

    def _release(self, peer: Peer, notif: bytes) -> None:
        try:
            self.transport.notify(peer, notif)
        except Exception as e:  # best effort: P's send timeout frees the blocks anyway
            log.debug("release notice to %s: %s", peer.agent_name, e)

    def _fail(self, task: RecvTask) -> None:
        self.report(recvd={task.req_id}, bad_blocks=task.local_block_ids)

    def report(self, sent: set[str] = frozenset(), recvd: set[str] = frozenset(),
                bad_blocks: Iterable[int] = ()) -> None:
        with self._ready:
            self._out.sent |= sent
            self._out.recvd |= recvd
            self._out.bad_blocks.update(bad_blocks)
            if self._out.any():
                self._ready.notify_all()
