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

from kvferry.connectors import messages
from kvferry.connectors.config import BUSY_POLL_S, IDLE_POLL_S, ConnectorConfig
from kvferry.connectors.handshake import HandshakeError, HandshakeServer, fetch
from kvferry.connectors.memory import KVLayout
from kvferry.connectors.push_worker import PushEndpoint, Ready
from kvferry.connectors.scheduler import PushSend, RecvTask, ReuseRead, StepMeta
from kvferry.connectors.transport import Peer, Transfer, Transport

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
    xfer: Transfer
    deadline: float
    started: float
    peer_key: str
    strict: bool = False  # a READ that ends after its deadline counts as failed


class TransferWorker:
    def __init__(self, cfg: ConnectorConfig, engine_id: str, rank: int, layout: KVLayout,
                 nixl_backends: list[str] | None = None, instance: str = "",
                 staging: Staging | None = None):
        self.cfg = cfg
        self.staging = staging  # None: KV moves straight from/to the registered layout
        self.engine_id = engine_id
        self.rank = rank
        self.instance = instance
        self.transport = Transport(layout, nixl_backends or cfg.transport_backends(),
                                   name=f"kvferry-{engine_id}-r{rank}",
                                   progress_delay_us=cfg.nixl_progress_delay_us)
        self._server = HandshakeServer(cfg.side_channel_host, cfg.side_channel_port + rank, {
            "engine_id": engine_id, "rank": rank, "instance": instance,
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
        self._addr_engine: dict[str, str] = {}
        self._instances: dict[str, str] = {}  # peer key -> the peer's boot id
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

    def peer_at(self, host: str, port: int, engine_id: str | None = None) -> tuple[str, Peer]:
        """(engine id, peer) for the same TP rank of the engine at host:port (cached).

        ``engine_id`` (when the caller knows it) must match what the side channel says.
        """
        key = f"{engine_id}/{self.rank}" if engine_id else f"{host}:{port}/{self.rank}"
        peer = self.transport.peer(key)
        if peer is not None:
            return engine_id or self._addr_engine[key], peer
        info = fetch(host, port + self.rank, self.cfg.handshake_timeout_s)
        found = str(info.get("engine_id"))
        if engine_id and found != engine_id:
            raise HandshakeError(f"{host}:{port} is engine {found!r}, expected {engine_id!r}")
        # One NIXL remote agent per peer engine, whichever key found it first (push
        # registrations know an address, pull offers and reuse an engine id): loading its
        # metadata twice would invalidate the transfers in flight to it.
        ekey, akey = f"{found}/{self.rank}", f"{host}:{port}/{self.rank}"
        instance = str(info.get("instance", ""))
        if self.transport.peer(ekey) is None or self._instances.get(ekey) != instance:
            self.transport.add_peer(ekey, info["metadata"], KVLayout.from_wire(info["layout"]))
        peer = self.transport.alias(akey, ekey)
        for k in (ekey, akey):
            self._addr_engine[k] = found
            self._instances[k] = instance
        return found, peer

    def drop_peer(self, host: str, port: int, engine_id: str | None = None) -> None:
        self.transport.drop_peer(f"{engine_id}/{self.rank}" if engine_id else f"{host}:{port}/{self.rank}")

    def _peer(self, task: RecvTask) -> Peer:
        o = task.offer
        return self.peer_at(o.remote_host, o.remote_port, o.remote_engine_id)[1]

    def _start_read(self, task: RecvTask, now: float) -> None:
        notif = messages.encode(messages.Done(task.offer.remote_request_id))
        try:
            peer = self._peer(task)
            if task.release_only:
                self.transport.notify(peer, notif)
                return
            budget = self.cfg.recv_timeout_s
            if task.offer.expiry:
                budget = min(budget, task.offer.expiry - time.time())
                if budget <= 0:
                    raise ValueError("offer expired: P may have freed those blocks")
            xfer = self.transport.start("READ", peer, task.local_block_ids,
                                        task.remote_block_ids, notif)
        except Exception as e:  # any failure of one request must end in a recompute, not a hang
            if task.release_only:
                log.warning("could not tell %s to free %s: %s", task.offer.remote_engine_id,
                            task.offer.remote_request_id, e)
                return
            log.warning("request %s: READ from %s failed (%s); recomputing", task.req_id,
                        task.offer.remote_engine_id, e)
            peer_key = f"{task.offer.remote_engine_id}/{self.rank}"
            if not isinstance(e, ValueError | IndexError):
                self.transport.drop_peer(peer_key)  # re-handshake next time (P may restart)
            elif (peer := self.transport.peer(peer_key)) is not None:
                self._release(peer, notif)  # bad ids, good peer: let P free now
            self._fail(task)
            return
        self._reads[task.req_id] = _Read(task, xfer, now + budget, now,
                                         f"{task.offer.remote_engine_id}/{self.rank}",
                                         strict=bool(task.offer.expiry))

    def _start_reuse(self, rr: ReuseRead, now: float) -> None:
        """P: READ D's leased blocks; any failure means recompute, never a wrong answer."""
        key = f"{rr.engine_id}/{self.rank}"
        try:
            _, peer = self.peer_at(rr.host, rr.port, rr.engine_id)
            if self._instances.get(key) != rr.instance:  # D restarted since we met it?
                self.drop_peer(rr.host, rr.port, rr.engine_id)
                _, peer = self.peer_at(rr.host, rr.port, rr.engine_id)
                if self._instances.get(key) != rr.instance:
                    raise HandshakeError("the lease belongs to an earlier run of that engine")
            budget = rr.deadline - time.time()
            if budget <= 0:
                raise TimeoutError("lease read deadline already passed")
            xfer = self.transport.start("READ", peer, rr.local_block_ids, rr.remote_block_ids)
        except Exception as e:
            log.warning("request %s: reuse READ from %s not started (%s); recomputing",
                        rr.req_id, rr.engine_id, e)
            if not isinstance(e, ValueError | IndexError | TimeoutError):
                self.transport.drop_peer(key)
            self.report(recvd={rr.req_id}, bad_blocks=rr.local_block_ids)
            return
        self._reads[rr.req_id] = _Read(rr, xfer, now + budget, now, key, strict=True)

    def _progress(self) -> None:
        now = time.monotonic()
        for req_id, rd in list(self._reads.items()):
            state = self.transport.poll(rd.xfer)
            if state == "PROC" and now < rd.deadline:
                continue
            del self._reads[req_id]
            if state == "DONE" and not (rd.strict and now > rd.deadline):
                log.info("kvferry %s %s: %d blocks, %d B in %d descriptors, %.1f ms",
                         "reuse READ" if isinstance(rd.task, ReuseRead) else "READ", req_id,
                         len(rd.task.local_block_ids), rd.xfer.nbytes, rd.xfer.ndesc,
                         (now - rd.started) * 1e3)
                ok = self.stage_in(req_id, rd.task.local_block_ids)
                self.report(recvd={req_id}, bad_blocks=() if ok else rd.task.local_block_ids)
            else:
                log.warning("request %s: READ %s; recomputing", req_id,
                            "failed" if state == "ERR" else "timed out")
                self.transport.release(rd.xfer)
                self.transport.drop_peer(rd.peer_key)
                self.report(recvd={req_id}, bad_blocks=rd.task.local_block_ids)
        for blob in self.transport.notifications():
            msg = messages.decode(blob)
            if isinstance(msg, messages.Done):
                if self._send_wait.pop(msg.req_id, None) is not None:
                    self.report(sent={msg.req_id})
                else:
                    self._early[msg.req_id] = now + self.cfg.send_timeout_s
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
