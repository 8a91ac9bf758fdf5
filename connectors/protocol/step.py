"""Step metadata: what the scheduler hands the transfer threads once per engine step.

The scheduler side (`scheduling/`) fills a `StepMeta`; the glue ships it to every worker
rank (vLLM's connector metadata); the transfer thread (`transfer/`) carries it out. Plain
data shared by both sides, so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.connectors.protocol.params import RemotePrefill


@dataclass
class RecvTask:
    """D reads ``remote_block_ids`` from P into ``local_block_ids`` (same order)."""

    req_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    offer: RemotePrefill
    release_only: bool = False  # nothing to read: just tell P to free its blocks


@dataclass
class RegisterTask:
    """Push, D: tell P where to write ``transfer_id``'s KV (tokens from ``first_token``)."""

    req_id: str
    transfer_id: str
    host: str
    port: int
    block_ids: list[int]
    first_token: int
    num_tokens: int
    prompt_hash: str


@dataclass
class PushSend:
    """Push, P: prefill of ``transfer_id`` done; its blocks wait for D's registration."""

    req_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    prompt_hash: str
    ended_at: float = 0.0  # wall clock (scheduler and workers may be other processes): the
    # transfer thread logs how long after the prefill ended the KV landed (the handoff's part)


@dataclass
class ReuseRead:
    """Bidirectional, P: READ D's leased history blocks before computing the rest."""

    req_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    engine_id: str
    instance: str  # D's boot id: a restarted D's blocks are never read
    host: str
    port: int
    deadline: float  # wall clock: abandon (and recompute) after this
    tp_size: int = 1  # D's: another size than P's means reading head segments per D rank
    # D's lease and control channel: P asks D that the lease still holds just before the
    # READ (D may have released it early, under memory pressure); without one, no READ
    lease_id: str = ""
    control_port: int = 0


@dataclass
class StepMeta:
    """Scheduler -> workers, once per engine step."""

    recv: list[RecvTask] = field(default_factory=list)
    send: list[str] = field(default_factory=list)  # P: request ids whose blocks wait for D
    register: list[RegisterTask] = field(default_factory=list)  # push, D
    push_send: list[PushSend] = field(default_factory=list)  # push, P
    # push, P: (transfer id, request id) of prefills cancelled before they finished
    push_abort_p: list[tuple[str, str]] = field(default_factory=list)
    push_abort_d: list[str] = field(default_factory=list)  # push, D: transfer ids cancelled
    reuse: list[ReuseRead] = field(default_factory=list)  # bidirectional, P
    # push, P (early push): prefills whose last prompt tokens this step computes; the
    # worker starts their WRITE once the forward's fence passed and a later step began
    # (whose meta would have named the request in push_preempted).
    push_ready: list[PushSend] = field(default_factory=list)
    # push, P: early-pushed requests vLLM preempted; it has freed their blocks already, so
    # no WRITE may read them and none is reported freed.
    push_preempted: list[tuple[str, str]] = field(default_factory=list)
    free: list[str] = field(default_factory=list)  # D: request ids whose lease ended
    # P, pull with host staging: blocks this step's forward writes, copied device -> host
    # mirror in wait_for_save so D's one-sided READ finds them (staged_saves.py).
    save: list[int] = field(default_factory=list)
    # The step computes nothing (every request waits for KV): the worker may wait briefly
    # for transfer results instead of returning at once to a spinning engine loop.
    idle: bool = False

    def has_push(self) -> bool:
        return bool(self.register or self.push_send or self.push_abort_p or self.push_abort_d
                    or self.push_ready or self.push_preempted)

    def has_work(self) -> bool:
        """Anything for the transfer thread (a step with none is not queued)."""
        return bool(self.recv or self.send or self.reuse or self.free or self.has_push())
