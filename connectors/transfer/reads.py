"""The READs this rank posts: D pulling a prefill from P, and P reusing D's leased KV.

Each READ ends as finished-receiving; a failed or timed-out READ also reports its local
block ids as load errors, so vLLM recomputes (or fails, per policy). A pull READ ends by
telling every P rank of `Ranks.release_plan` that its blocks may go.

A READ is reported (its local blocks go back to vLLM, P's blocks are released) only once
the transport said it ended, DONE or ERR: vLLM keeps an aborted request's blocks until
then. A READ still in flight at its deadline is *fenced* first: its source engine's agent
is removed, which ends every transfer NIXL has in flight to it (UCX closes the endpoint,
its outstanding operations complete with an error), and the READ is reported failed once
a poll says it ended; releasing the handle alone is no fence (NIXL may not be able to
recall an RMA the NIC already has). Only a transport that reports nothing for
`FENCE_S` more is given up on (``transfers_unfenced``, never seen in a healthy run).

A READ that ended DONE may be checked before it is reported (transfer/verify.py): its
blocks' checksums against the source's; a mismatch or no answer is a failed READ.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvferry.connectors.protocol import messages
from kvferry.connectors.protocol.step import RecvTask, ReuseRead
from kvferry.connectors.protocol.tp_map import Segment
from kvferry.connectors.transfer import faults, verify
from kvferry.connectors.transfer.lease_control import LeaseCheck
from kvferry.connectors.transfer.peers import gone
from kvferry.connectors.transfer.rank_io import RankIO, RankPart
from kvferry.connectors.transfer.transport import FENCE_S, Peer, Transfer, XferState

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers


@dataclass
class _Read:
    task: RecvTask | ReuseRead
    xfers: list[Transfer]  # one per source rank segment when its TP size differs from ours
    deadline: float
    started: float
    engine_id: str  # the source engine and its TP size: every rank is dropped on failure
    engine_tp: int
    strict: bool = False  # a READ that ends after its deadline counts as failed
    notices: list[tuple[Peer, bytes]] = field(default_factory=list)  # sent once all are done
    release: list[tuple[Peer, bytes]] = field(default_factory=list)  # pull: P's Done, also on failure
    release_ranks: list[int] = field(default_factory=list)  # the P rank of each `release`
    fenced_at: float | None = None  # past its deadline in flight: the source's agent removed
    check: bool = False  # compare checksums with the source once DONE (verify.py)
    source: tuple[str, int] | None = None  # the source rank's side channel (whole blocks)


@dataclass
class _Checking:
    """A reuse READ waiting for D's answer that its lease still holds."""

    task: ReuseRead
    check: LeaseCheck
    pieces: list[tuple[int, list[Segment] | None]]
    peers: dict[int, Peer]
    started: float


class Reads(RankPart):
    """The READs one rank posts (D's pull, P's reuse), each ending exactly once as
    finished-receiving, with its blocks reported bad on failure."""

    def __init__(self, io: RankIO, recv_timeout_s: float, checksums: verify.Mode = "off",
                 checksum_fraction: float = 0.0) -> None:
        super().__init__(io)
        self.recv_timeout_s = recv_timeout_s
        self.checksums, self.checksum_fraction = checksums, checksum_fraction
        self._reads: dict[str, _Read] = {}
        self._checks: dict[str, _Checking] = {}
        self._verifying: dict[str, tuple[_Read, verify.Check]] = {}

    def busy(self) -> bool:
        return bool(self._reads or self._checks or self._verifying)

    def _wants_check(self, req_id: str) -> bool:
        return verify.wanted(self.checksums, self.checksum_fraction, req_id)

    @staticmethod
    def _source(host: str, port: int, pieces: list[tuple[int, list[Segment] | None]]
                ) -> tuple[str, int] | None:
        """The one source rank's side channel when we read whole blocks from it alone."""
        if len(pieces) == 1 and pieces[0][1] is None:
            return host, port + pieces[0][0]
        return None

    def start_pull(self, task: RecvTask, now: float) -> None:
        """D: READ our heads of the offered blocks (`Ranks.read_plan`), then tell every P
        rank of `Ranks.release_plan` that we are done. A single READ from the only rank to
        tell carries the notice itself (NIXL sends it after the data)."""
        o = task.offer
        xfers: list[Transfer] = []
        msgs: list[tuple[Peer, bytes]] = []
        try:
            notices = self.ranks.release_plan(o.remote_tp_size)
            pieces = [] if task.release_only else self.ranks.read_plan(o.remote_tp_size, "prefill")
            peers = {p: self.peers.at(o.remote_host, o.remote_port, o.remote_engine_id, p)[1]
                     for p in {*notices, *(r for r, _ in pieces)}}
            msgs = [(peers[p], messages.encode(messages.Done(o.remote_request_id, n)))
                    for p, n in notices.items()]
            if task.release_only:
                for peer, m in msgs:
                    self.transport.notify(peer, m)
                return
            budget = self._read_budget(task)
            check = self._wants_check(task.req_id)  # P's Done then waits for the check
            attach = len(pieces) == 1 and list(notices) == [pieces[0][0]] and not check
            for r, segs in pieces:
                xfers.append(self.transport.start("READ", peers[r], task.local_block_ids,
                                                  task.remote_block_ids,
                                                  msgs[0][1] if attach else b"",
                                                  seg=None if segs is None else (segs, False)))
        except Exception as e:  # any failure of one request must end in a recompute, not a hang
            for x in xfers:
                self.transport.release(x)
            if task.release_only:
                log.warning("could not tell %s to free %s: %s", o.remote_engine_id,
                            o.remote_request_id, e)
                return
            log.warning("request %s: READ from %s (TP %d -> %d) failed (%s); recomputing",
                        task.req_id, o.remote_engine_id, o.remote_tp_size, self.ranks.tp_size, e)
            self.stats.event("reads_failed", task.req_id, f"not started: {e}")
            self.stats.event("recomputes", task.req_id, "READ not started")
            for peer, m in msgs:  # nothing of ours reads P's blocks: P frees them now
                self.peers.send(peer, m)
            if not isinstance(e, ValueError | IndexError):
                self.peers.drop_engine(o.remote_engine_id, o.remote_tp_size)  # P may restart
            self.out.report(recvd={task.req_id}, bad_blocks=task.local_block_ids)
            return
        self._reads[task.req_id] = _Read(task, xfers, now + budget, now, o.remote_engine_id,
                                         o.remote_tp_size, strict=bool(o.expiry),
                                         notices=[] if attach else msgs, release=msgs,
                                         release_ranks=list(notices), check=check,
                                         source=self._source(o.remote_host, o.remote_port,
                                                             pieces))

    def _read_budget(self, task: RecvTask) -> float:
        budget = self.recv_timeout_s
        if task.offer.expiry:
            budget = min(budget, task.offer.expiry - time.time())
            if budget <= 0:
                raise ValueError("offer expired: P may have freed those blocks")
        return budget

    def start_reuse(self, rr: ReuseRead, now: float) -> None:
        """P: READ D's leased blocks (from each D rank holding some of our heads when D
        has another TP size) once D has answered that the lease still holds; any failure
        means recompute, never a wrong answer."""
        try:
            pieces = self.ranks.read_plan(rr.tp_size, "decode")
            peers = {r: self.peers.of_instance(rr.host, rr.port, rr.engine_id, r, rr.instance)
                     for r in {r for r, _ in pieces}}
            if rr.deadline - time.time() <= 0:
                raise TimeoutError("lease read deadline already passed")
            if not rr.lease_id:
                raise ValueError("offer names no lease to check")
        except Exception as e:
            self._reuse_not_started(rr, e)
            return
        # The check is part of the READ and may take what is left of its time (CI, two
        # engines per core: D's control thread answered after more than 0.5 s); the
        # transfer thread goes on with other transfers meanwhile (`_poll_checks`).
        self._checks[rr.req_id] = _Checking(rr, LeaseCheck(rr.host, rr.control_port,
                                                           rr.lease_id), pieces, peers, now)

    def _poll_checks(self, now: float) -> None:
        for req_id, c in list(self._checks.items()):
            rr = c.task
            answered, why = c.check.poll()
            if not answered and time.time() < rr.deadline:
                continue
            del self._checks[req_id]
            c.check.close()
            if not answered:
                self._reuse_not_started(rr, TimeoutError("D did not answer that the lease "
                                                         "holds before the READ's deadline"))
            elif why is not None:
                self._reuse_not_started(rr, ValueError(f"lease ended on D: {why}"))
            else:
                self._start_reuse_xfers(c, now)

    def _start_reuse_xfers(self, c: _Checking, now: float) -> None:
        rr, xfers = c.task, []
        try:
            budget = rr.deadline - time.time()
            if budget <= 0:
                raise TimeoutError("lease read deadline passed during the lease check")
            for r, segs in c.pieces:
                xfers.append(self.transport.start("READ", c.peers[r], rr.local_block_ids,
                                                  rr.remote_block_ids,
                                                  seg=None if segs is None else (segs, False)))
        except Exception as e:
            for x in xfers:
                self.transport.release(x)
            self._reuse_not_started(rr, e)
            return
        self._reads[rr.req_id] = _Read(rr, xfers, now + budget, c.started, rr.engine_id,
                                       rr.tp_size, strict=True,
                                       check=self._wants_check(rr.req_id),
                                       source=self._source(rr.host, rr.port, c.pieces))

    def _reuse_not_started(self, rr: ReuseRead, e: Exception) -> None:
        log.warning("request %s: reuse READ from %s not started (%s); recomputing",
                    rr.req_id, rr.engine_id, e)
        self.stats.event("reuse_reads_failed", rr.req_id, f"not started: {e}")
        self.stats.event("recomputes", rr.req_id, "reuse READ not started")
        if not isinstance(e, ValueError | IndexError | TimeoutError):
            self.peers.drop_engine(rr.engine_id, rr.tp_size)
        self.out.report(recvd={rr.req_id}, bad_blocks=rr.local_block_ids)

    def progress(self, now: float) -> None:
        """Poll every lease check and READ in flight; report each READ that ended or ran
        past its deadline."""
        if self._checks:
            self._poll_checks(now)
        if self._verifying:
            self._poll_verifying(now)
        for req_id, rd in list(self._reads.items()):
            state = self.transport.poll_all(rd.xfers)
            if state == XferState.PROC and now < rd.deadline:
                continue
            if state == XferState.PROC and rd.fenced_at is None:
                rd.fenced_at = now  # reported once the transport says the READ ended
                self.stats.event("transfers_fenced", req_id)
                for x in rd.xfers:
                    self.transport.drop_agent(x.peer)
                continue
            if state == XferState.PROC and now < rd.fenced_at + FENCE_S:
                continue
            if state == XferState.PROC:
                self.stats.event("transfers_unfenced", req_id)
            del self._reads[req_id]
            if state == XferState.DONE and rd.fenced_at is None and not (
                    rd.strict and now > rd.deadline):
                if faults.ACTIVE:
                    self._corrupt(req_id, rd)
                if rd.check and self._start_check(req_id, rd, now):
                    continue  # reported once the source's checksums came (or did not)
                log.info("kvferry %s %s: %d blocks, %d B in %d descriptors, %.1f ms",
                         "reuse READ" if isinstance(rd.task, ReuseRead) else "READ", req_id,
                         len(rd.task.local_block_ids), sum(x.nbytes for x in rd.xfers),
                         sum(x.ndesc for x in rd.xfers), (now - rd.started) * 1e3)
                self._deliver(req_id, rd)
            else:
                log.warning("request %s: READ %s; recomputing", req_id,
                            "failed" if state == XferState.ERR else "timed out")
                self.stats.event("reuse_reads_failed" if isinstance(rd.task, ReuseRead)
                                 else "reads_failed", req_id,
                                 "failed" if state == XferState.ERR else "timed out")
                self.stats.event("recomputes", req_id, "READ did not complete")
                for x in rd.xfers:
                    self.transport.release(x)
                if rd.fenced_at is None:
                    for peer, msg in rd.release:  # READ ended: P need not hold its blocks
                        self.peers.send(peer, msg)
                    self.peers.drop_engine(rd.engine_id, rd.engine_tp)
                else:  # the agent we read through is gone: tell P through a new one
                    self._tell_p_again(rd)
                self.out.report(recvd={req_id}, bad_blocks=rd.task.local_block_ids)

    def _deliver(self, req_id: str, rd: _Read) -> None:
        """A READ that ended well: P may free what we read, the blocks are received."""
        reuse = isinstance(rd.task, ReuseRead)
        self.stats.event("reuse_reads_done" if reuse else "reads_done", req_id)
        self.stats.add("bytes_read", sum(x.nbytes for x in rd.xfers))
        for peer, msg in rd.notices:
            self.peers.send(peer, msg)
        ok = self.mirror.stage_in(req_id, rd.task.local_block_ids)
        self.out.report(recvd={req_id}, bad_blocks=() if ok else rd.task.local_block_ids)

    def _start_check(self, req_id: str, rd: _Read, now: float) -> bool:
        """Checksum the blocks that arrived and ask the source for its own; False when this
        READ cannot be checked (counted, then delivered as before)."""
        local_ids = rd.task.local_block_ids
        why = "head segments (another TP size)" if rd.source is None else (
            "" if self.sums.available else self.sums.why_not)
        local: list[int] = []
        if not why:
            try:
                local = self.sums.sums(local_ids)
            except Exception as e:  # never a lost READ: unchecked, delivered
                why = f"{type(e).__name__}: {e}"
        if why or rd.source is None:
            self.stats.event("checksums_unchecked", req_id, why)
            return False
        self._verifying[req_id] = (rd, verify.Check(*rd.source, rd.task.remote_block_ids,
                                                    local, now))
        return True

    def _corrupt(self, req_id: str, rd: _Read) -> None:
        """Chaos (faults.py's ``corrupt``): a byte the transfer got wrong, in the first
        block that landed, whether or not the READ is checked."""
        if rd.task.local_block_ids and self.sums.available and faults.hit("corrupt"):
            self.sums.flip_byte(rd.task.local_block_ids[0])
            self.stats.event("corruptions_injected", req_id)

    def _poll_verifying(self, now: float) -> None:
        for req_id, (rd, check) in list(self._verifying.items()):
            ended, why = check.poll(now)
            if not ended:
                continue
            del self._verifying[req_id]
            if why is None:
                # what the check added to this READ (bench: checksum_cost.py reads it)
                self.stats.event("checksums_verified", req_id,
                                 f"{(time.monotonic() - check.started) * 1e3:.3f} ms")
                self._deliver(req_id, rd)
                continue
            name = "checksums_unanswered" if why.startswith("unanswered") else "checksum_mismatches"
            log.warning("request %s: KV checksum %s; recomputing", req_id, why)
            self.stats.event(name, req_id, why)
            self.stats.event("recomputes", req_id, f"checksum {why}")
            for peer, msg in rd.notices:  # the READ itself ended: P may free its blocks
                self.peers.send(peer, msg)
            self.out.report(recvd={req_id}, bad_blocks=rd.task.local_block_ids)

    def _tell_p_again(self, rd: _Read) -> None:
        """A fenced pull READ's Done to every P rank of its release plan, meeting P afresh."""
        if not isinstance(rd.task, RecvTask):
            return
        o = rd.task.offer
        for r, (_, msg) in zip(rd.release_ranks, rd.release, strict=True):
            if gone(o.remote_host, o.remote_port + r):  # P died: nothing to free, no wait
                continue
            try:
                self.peers.send(self.peers.at(o.remote_host, o.remote_port, o.remote_engine_id,
                                              r)[1], msg)
            except Exception as e:  # P gone: its send timeout frees the blocks
                log.warning("could not tell %s to free %s: %s", o.remote_engine_id,
                            o.remote_request_id, e)
