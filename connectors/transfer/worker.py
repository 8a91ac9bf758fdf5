"""Worker-side transfers, on one background thread per engine rank.

The engine loop only hands tasks over (`submit`) and collects results (`results`); the
handshake, descriptor building, NIXL posting and polling all happen on the transfer
thread, so a slow or dead peer never stalls token generation. The thread's parts, each
with its own state: `Peers` (handshakes, one remote agent per peer rank), `Reads` (D's
pull READs, P's reuse READs), `Sends` (P's blocks waiting for D's READ), `PushRecv` (D's
push registrations) and `PushWrite` (P's push WRITEs); they report into one `ResultBox`.

Host staging (Neuron without device registration): the layout is a pinned DRAM mirror of
the device KV and `Mirror` copies between the two (transfer/mirror.py says when).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from kvferry.connectors.config import BUSY_POLL_S, IDLE_POLL_S, ConnectorConfig
from kvferry.connectors.memory.backends import KVLayout
from kvferry.connectors.memory.checksum import BlockSums
from kvferry.connectors.protocol import messages, send_release
from kvferry.connectors.protocol.lease_control import Refused
from kvferry.connectors.protocol.params import PROTOCOL_VERSION
from kvferry.connectors.protocol.step import PushSend, StepMeta
from kvferry.connectors.protocol.tp_map import Ranks
from kvferry.connectors.transfer import verify
from kvferry.connectors.transfer.backend_settings import add_peer_bound
from kvferry.connectors.transfer.handshake import HandshakeServer
from kvferry.connectors.transfer.layer_push import LayerFence
from kvferry.connectors.transfer.mirror import Mirror, Staging
from kvferry.connectors.transfer.peers import Peers
from kvferry.connectors.transfer.push_recv import PushRecv
from kvferry.connectors.transfer.push_write import PushWrite, Ready
from kvferry.connectors.transfer.rank_io import RankIO
from kvferry.connectors.transfer.reads import Reads
from kvferry.connectors.transfer.results import ResultBox, Results
from kvferry.connectors.transfer.sends import Sends
from kvferry.connectors.transfer.stats import Stats
from kvferry.connectors.transfer.transport import Transport

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers


class TransferWorker:
    """One engine rank's transfers: the engine loop submits step metadata and collects
    results; a background thread does the rest (module docstring)."""

    def __init__(self, cfg: ConnectorConfig, engine_id: str, rank: int, layout: KVLayout,
                 nixl_backends: list[str] | None = None, instance: str = "",
                 staging: Staging | None = None, tp_size: int = 1, num_heads: int = 0):
        """``num_heads``: the model's KV heads (all ranks); 0: unknown, so only peers of
        our own TP size are served."""
        self.cfg = cfg
        self.engine_id = engine_id
        self.instance = instance  # our boot id, in the handshake
        self.ranks = Ranks(rank, tp_size, num_heads)
        backends = nixl_backends or cfg.transport_backends()
        self.transport = Transport(layout, backends, name=f"kvferry-{engine_id}-r{rank}",
                                   progress_delay_us=cfg.nixl_progress_delay_us,
                                   add_peer_timeout_s=add_peer_bound(
                                       backends, cfg.handshake_timeout_s, cfg.recv_timeout_s))
        self.stats = Stats(engine_id, rank)  # served on the side channel (b"stats")
        hello = messages.Hello(engine_id, rank, self.transport.metadata(), layout.to_wire(),
                               tp_size, instance, PROTOCOL_VERSION,
                               nixl_backends=list(self.transport.backends))
        self._server = HandshakeServer(cfg.side_channel_host, cfg.side_channel_port + rank,
                                       msgspec.to_builtins(hello))
        self._server.stats = self.stats
        self._server.on_release = self._on_release
        self._inbox: queue.Queue[tuple[StepMeta, int] | Ready | LayerFence
                                 | send_release.ReleaseSend] = queue.Queue()
        self.steps = 0  # engine steps begun (set by the engine thread)
        self.out = ResultBox()
        self.mirror = Mirror(staging, self.stats)
        self.peers = Peers(self.transport, rank, cfg.handshake_timeout_s)
        sums = BlockSums(layout)
        self._server.on_sums = lambda req: verify.answer(sums, req)
        io = RankIO(self.transport, self.peers, self.ranks, self.out, self.mirror, self.stats,
                    sums)
        self.reads = Reads(io, cfg.recv_timeout_s, cfg.kv_checksums, cfg.kv_checksum_fraction)
        self.sends = Sends(self.out, cfg.send_timeout_s, self.stats)
        self.push_recv = PushRecv(cfg, engine_id, io)
        self.push_write = PushWrite(cfg, io, steps=lambda: self.steps, drain=self._drain_inbox)
        self._stop = threading.Event()
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
        if meta.has_work():
            self._inbox.put((meta, step))
        self.steps = max(self.steps, step)

    def forward_done(self, items: Sequence[PushSend], fence: Any, step: int) -> None:
        """Early push, after step ``step``'s forward was enqueued: these prompts are
        complete once ``fence`` passes (None: already)."""
        self._inbox.put(Ready(list(items), fence, step))

    @property
    def layerwise(self) -> bool:
        """Layer-wise push is on for this rank (config, per-layer planes, UCX)."""
        return self.push_write.layerwise

    def layer_done(self, layer: int, fence: Any, step: int) -> None:
        """Layer-wise push, from save_kv_layer in step ``step``: that layer's KV is
        written once ``fence`` passes (None: already)."""
        self._inbox.put(LayerFence(step, layer, fence))

    def save(self, block_ids: Sequence[int]) -> None:
        """Engine thread, after the forward: copy these blocks device -> host mirror.

        Raises on failure: the offer for these blocks is about to be published and D would
        READ a stale mirror, a wrong answer; failing the step is the honest outcome.
        """
        self.mirror.stage_out(block_ids)

    def results(self, wait_s: float = 0.0) -> Results:
        """Everything reported since the last call; with ``wait_s``, first wait up to that
        long for something to be reported (an engine step with nothing to compute)."""
        return self.out.take(wait_s)

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
                self.stats.add("thread_errors")

    def _on_release(self, blob: bytes) -> bytes:
        """Side-channel thread: the router's signed word that no D will read a request's
        blocks; the transfer thread frees them (`Sends.release`)."""
        try:
            req = send_release.parse(blob)
        except Refused as e:
            return send_release.reply(False, e.reason)
        self._inbox.put(req)
        return send_release.reply(True)

    def _take(self, item: tuple[StepMeta, int] | Ready | LayerFence
              | send_release.ReleaseSend) -> None:
        if isinstance(item, send_release.ReleaseSend):
            if item.transfer_id:  # push: as D's own Abort (blocks under a WRITE: after it)
                self.push_write.on_message(messages.Abort(item.transfer_id), time.monotonic())
            else:
                self.sends.release(item.req_id, time.monotonic())
        elif isinstance(item, Ready):
            self.push_write.ready(item)
        elif isinstance(item, LayerFence):
            self.push_write.layer_fence(item)
        else:
            self._accept(*item)

    def _drain_inbox(self) -> None:
        """Act on everything queued so far."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._take(item)

    def _poll_s(self) -> float:
        """How long the thread may sleep before it next polls transfers and notifications."""
        if self.reads.busy() or self.push_write.busy():
            return BUSY_POLL_S
        if self.push_write.awaiting() or self.push_recv.awaiting():
            return self.cfg.notif_poll_s
        return IDLE_POLL_S

    def _accept(self, meta: StepMeta, step: int = 0) -> None:
        now = time.monotonic()
        self.sends.hold(meta.send, now)
        for task in meta.recv:
            self.reads.start_pull(task, now)
        for rr in meta.reuse:
            self.reads.start_reuse(rr, now)
        if meta.free:  # D: leases ended; vLLM frees these requests' blocks
            self.out.report(sent=set(meta.free))
        self.push_recv.accept(meta, now)
        self.push_write.accept(meta, now, step)

    def _progress(self) -> None:
        now = time.monotonic()
        self.reads.progress(now)
        for blob in self.transport.notifications():
            self.stats.add("notifications")
            msg = messages.decode(blob)
            if isinstance(msg, messages.Done):
                self.sends.on_done(msg, now)
            elif isinstance(msg, messages.Register | messages.Abort):
                self.push_write.on_message(msg, now)
            elif isinstance(msg, messages.Wrote | messages.Sums | messages.Rejected):
                self.push_recv.on_message(msg, now)
            else:
                log.warning("ignoring a notification that is not a kvferry message")
                self.stats.add("notifications_bad")
        self.push_write.progress(now)
        self.push_recv.progress(now)
        self.sends.expire(now)
