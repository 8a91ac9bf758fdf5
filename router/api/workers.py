"""Several router processes on one port: the data plane uses every core it is given.

Each worker is a whole router (its own event loop, engine connections, admission bound)
listening on the same port with SO_REUSEPORT, so the kernel spreads connections over
them. They share the conversation registry through the Redis state backend
(`--state redis://`): with the in-memory default each would keep conversations of its
own, so more than one worker needs Redis (`kvferry up` runs one worker, no extra service).
Prometheus metrics are per worker (a scrape reaches one of them).

The parent forks the workers before any event loop or thread exists, passes SIGTERM and
SIGINT on to them as SIGTERM (each worker drains), and exits 0 once all did.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from types import FrameType

from ..settings import RouterSettings


def check(settings: RouterSettings, workers: int) -> str | None:
    """Why `workers` cannot serve these settings, or None."""
    if workers < 1:
        return "--workers must be at least 1"
    if workers > 1 and settings.state == "memory":
        return ("--workers > 1 needs --state redis://...: each worker process would keep "
                "conversations of its own")
    return None


def listener(host: str, port: int) -> socket.socket:
    """A listening socket that other workers may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve_workers(settings: RouterSettings, host: str, port: int, log_level: str,
                  workers: int) -> int:
    """Run `workers` routers on host:port until they exit; the exit status."""
    from .app import serve

    if workers == 1:
        serve(settings, host=host, port=port, log_level=log_level)
        return 0
    pids = []
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:  # the worker: a whole router on its own socket of the shared port
            code = 0
            try:
                serve(settings, host=host, port=port, log_level=log_level,
                      sock=listener(host, port))
            except BaseException:  # noqa: BLE001 - a worker's failure is its exit status
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
