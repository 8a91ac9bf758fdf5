"""How kvferry sets NIXL's backends up and bounds them: settings and rules only, no NIXL
call (`transport.py` makes the calls)."""

from __future__ import annotations

import os
from collections.abc import Sequence

ADD_WAITS_ON_PEER = frozenset({"LIBFABRIC"})
"""Backends whose add_remote_agent waits on the peer (LIBFABRIC blocks while it is
unreachable: the module docstring). UCX's only creates endpoints (ucp_ep_create, which
connects lazily: NIXL src/plugins/ucx/ucx_utils.cpp) and fails at once for a dead peer."""


def add_peer_bound(backends: Sequence[str], handshake_timeout_s: float,
                   local_bound_s: float) -> float:
    """How long `Transport.add_peer` may take: the handshake's bound where adding waits on
    the peer; else ``local_bound_s`` (the transfer's own deadline), since then it is local
    work that only a starved process slows down, and giving up early would only turn a
    busy machine's transfer into a recompute (seen on CI's two cores: over 5 s)."""
    return handshake_timeout_s if ADD_WAITS_ON_PEER & set(backends) else local_bound_s


UCX_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
"""UCX settings every kvferry agent starts with, unless the environment sets them.

UCX's cuda_ipc transport leaves GET (NIXL READ) off by default ("auto: enable get
operations except for platforms known to have slower performance", libuct_cuda's
ENABLE_GET_ZCOPY). Measured on one H200 with P and D sharing it (UCX_PROTO_INFO=y): a READ
between the two processes was then "software emulation | tcp/lo", 2.4-2.6 s per GiB, while
a WRITE took 1.1 ms; with it on, the READ is "zero-copy | cuda_ipc/cuda", 1.0-1.5 ms per
GiB, and a pulled 16k-token prompt (1.88 GB) moved in 1.8-4 ms instead of 27 s."""


def ucx_defaults() -> dict[str, str]:
    """Apply UCX_DEFAULTS where unset (UCX reads its environment when an agent's context
    is created); returns what was set."""
    out = {k: v for k, v in UCX_DEFAULTS.items() if k not in os.environ}
    os.environ.update(out)
    return out
