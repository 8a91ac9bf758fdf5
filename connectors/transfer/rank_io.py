"""What every part of one rank's transfer thread works through (transfer/worker.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.connectors.memory.checksum import BlockSums
from kvferry.connectors.protocol.tp_map import Ranks
from kvferry.connectors.transfer.mirror import Mirror
from kvferry.connectors.transfer.peers import Peers
from kvferry.connectors.transfer.results import ResultBox
from kvferry.connectors.transfer.stats import Stats
from kvferry.connectors.transfer.transport import Transport


@dataclass(frozen=True)
class RankIO:
    """The rank's transport (its one NIXL agent), the peers it met, its place in the TP
    plan, where results are reported and the host mirror (if staging); its counters."""

    transport: Transport
    peers: Peers
    ranks: Ranks
    out: ResultBox
    mirror: Mirror
    stats: Stats  # served on the side channel (b"stats")
    sums: BlockSums = field(default_factory=lambda: BlockSums(None))  # checksums of our blocks


class RankPart:
    """A part of the transfer thread (`Reads`, `PushRecv`, `PushWrite`) over `RankIO`."""

    def __init__(self, io: RankIO) -> None:
        self.transport = io.transport
        self.peers = io.peers
        self.ranks = io.ranks
        self.out = io.out
        self.mirror = io.mirror
        self.stats = io.stats
        self.sums = io.sums
