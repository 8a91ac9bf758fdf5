"""Running the router: uvicorn serving `app.create_app`'s app on a socket the router
accepts on itself (`accept.Acceptor`), draining on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

from ..settings import RouterSettings
from ..wire.sse import RawSend
from . import accept
from .app import create_app

log = logging.getLogger(__name__)


def serve(settings: RouterSettings, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", sock: socket.socket | None = None) -> None:
    """Run the router under uvicorn (blocking) until SIGINT, or SIGTERM: then drain.

    Draining is uvicorn's graceful shutdown (listener closed, in-flight requests and
    streams finish, bounded by ``drain_timeout_s``); the process then exits 0, as an
    orchestrator expects of a replica it asked to stop. ``sock``: a listening socket to
    serve on instead of binding host:port (a worker of `workers.serve_workers`). Client
    connections are accepted by the router's own `accept.Acceptor`, not uvicorn's
    listener (uvloop's leaves them queued while the loop is busy).
    """
    import uvicorn

    app = create_app(settings)
    try:
        listening = sock if sock is not None else accept.bind(host, port)
    except OSError as exc:  # as uvicorn's own bind failure: a line and exit status 3
        log.error("cannot listen on %s:%d: %s", host, port, exc)
        raise SystemExit(3) from None

    class DrainingServer(uvicorn.Server):
        """uvicorn whose SIGTERM drains: new requests get 503 while open ones finish."""

        acceptor: accept.Acceptor | None = None

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=[])  # the lifespan; the listener is ours
            loop = asyncio.get_running_loop()
            config, state = self.config, self.server_state

            def protocol() -> asyncio.Protocol:  # as uvicorn's own listener makes them
                return config.http_protocol_class(  # type: ignore[call-arg]
                    config=config, server_state=state, app_state=self.lifespan.state,
                    _loop=loop)

            self.acceptor = accept.Acceptor(listening, protocol, loop)
            log.info("router listening on http://%s:%d", host, port)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            if self.acceptor is not None:
                self.acceptor.close()
            listening.close()
            await super().shutdown(sockets)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if sig == signal.SIGTERM:
                app.state.draining = True
                app.state.metrics.draining.set(1)
                log.info("SIGTERM: draining (up to %.0f s for in-flight requests)",
                         settings.drain_timeout_s)
                self.should_exit = True  # not re-raised at exit: a drained router exits 0
                return
            super().handle_exit(sig, frame)

    # Nothing logged per request at the default level: uvicorn's access line and httpx's
    # "HTTP Request" line cost the token path a formatted write each (debug keeps them).
    verbose = log_level.lower() in ("debug", "trace")
    if not verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)
    config = uvicorn.Config(RawSend(app), host=host, port=port, log_level=log_level,
                            access_log=verbose,
                            timeout_graceful_shutdown=settings.drain_timeout_s)
    DrainingServer(config).run()
