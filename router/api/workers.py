"""Several router processes on one port: the data plane uses every core it is given.

Each worker is a whole router (its own event loop, engine connections, admission bound)
listening on the same port with SO_REUSEPORT, so the kernel spreads connections over
them. They share the conversation registry: through Redis when `--state redis://` names
one (replicas on other hosts share it too), else through a SQLite file the parent makes
on tmpfs before forking them (router/conversations/sqlite_state.py) and removes once they
exited, so `--workers N` needs no extra service. Prometheus metrics are per worker (a
scrape reaches one of them).

The parent forks the workers before any event loop or thread exists, passes SIGTERM and
SIGINT on to them as SIGTERM (each worker drains), and exits 0 once all did.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
from pathlib import Path
from types import FrameType

from ..conversations.sqlite_state import URL_PREFIX, connect
from ..settings import RouterSettings
from . import accept

log = logging.getLogger(__name__)

SHM = Path("/dev/shm")
"""tmpfs on Linux: the workers' state file never touches a disk."""
SHM_MIN_FREE = 1 << 30
"""Below this free in /dev/shm (Docker and Kubernetes give 64 MiB unless told otherwise)
the file goes to the temporary directory instead: a full store only costs reuse, but a
large conversation's entry (its offer lists every block) takes tens of KiB."""


def state_dir() -> Path:
    """Where the workers' state file goes."""
    if SHM.is_dir() and shutil.disk_usage(SHM).free >= SHM_MIN_FREE:
        return SHM
    return Path(tempfile.gettempdir())  # TMPDIR or /tmp: the page cache keeps it in memory


def check(settings: RouterSettings, workers: int) -> str | None:
    """Why `workers` cannot serve these settings, or None."""
    if workers < 1:
        return "--workers must be at least 1"
    return None


def shared_state(settings: RouterSettings) -> tuple[RouterSettings, Path | None]:
    """The settings the workers run with: `memory` becomes a SQLite file they share (made
    here, once, before they open it), returned with its directory for removal at exit."""
    if settings.state != "memory":
        return settings, None
    folder = Path(tempfile.mkdtemp(prefix="kvferry-router-", dir=state_dir()))
    path = folder / "conversations.db"
    connect(str(path), settings.state_timeout_s).close()
    log.info("router workers share conversation state in %s", path)
    return settings.model_copy(update={"state": URL_PREFIX + str(path)}), folder


def listener(host: str, port: int) -> socket.socket:
    """A listening socket that other workers may bind too (SO_REUSEPORT)."""
    return accept.bind(host, port, reuse_port=True)


def serve_workers(settings: RouterSettings, host: str, port: int, log_level: str,
                  workers: int) -> int:
    """Run `workers` routers on host:port until they exit; the exit status."""
    from .server import serve

    if workers == 1:
        serve(settings, host=host, port=port, log_level=log_level)
        return 0
    settings, folder = shared_state(settings)
    try:
        return _fork(settings, host, port, log_level, workers)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _fork(settings: RouterSettings, host: str, port: int, log_level: str, workers: int) -> int:
    from .server import serve

    pids = []
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:  # the worker: a whole router on its own socket of the shared port
            code = 0
            try:
                serve(settings, host=host, port=port, log_level=log_level,
                      sock=listener(host, port))
            except BaseException:  # noqa: BLE001 - a worker's failure is its exit status
                log.exception("router worker %d failed", os.getpid())
                code = 1
            os._exit(code)
        pids.append(pid)

    def forward(_sig: int, _frame: FrameType | None) -> None:
        # As SIGTERM: each worker drains. (A terminal's Ctrl-C reaches the workers
        # themselves too; a second SIGINT would make uvicorn abandon their streams.)
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status = 0
    for p in pids:
        _, code = os.waitpid(p, 0)
        status = status or os.waitstatus_to_exitcode(code)
    return status
