"""The completions endpoints served from the app's own ASGI call, past FastAPI's and
Starlette's layers (error and exception middlewares, routing, the dependency solver, the
exit stack): those layers were about a quarter of the router's CPU per request (py-spy,
2-token streams, issue 33), paid by every request's time to first token under bursts.

Only POSTs to the paths in `RouterApp.direct` take this way; every other request (other
paths, other methods on these, the lifespan) goes through FastAPI as before. A handler
that raises reaches the server, which answers 500 when nothing was sent yet, as
Starlette's error middleware did."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from fastapi import FastAPI, Request, Response
from starlette.types import ASGIApp, Receive, Scope, Send

Handler = Callable[[Request], Awaitable[Response]]


def as_endpoint(handler: Handler) -> ASGIApp:
    """`handler` as a bare ASGI app: the request in, its response sent."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        response = await handler(Request(scope, receive, send))
        await response(scope, receive, send)

    return app


class RouterApp(FastAPI):
    """FastAPI whose `direct` paths (POST only) skip the framework's layers."""

    direct: Mapping[str, ASGIApp] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            app = self.direct.get(scope["path"])
            if app is not None:
                scope["app"] = self
                await app(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
