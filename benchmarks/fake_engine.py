"""A FAKE vLLM OpenAI server for router benchmarks: answers like a prefill or decode
engine at no compute cost, so a router's own CPU per streamed chunk can be measured.

It is cheap itself (raw asyncio protocol on uvloop; one timer for all open streams), so a
fake engine on the second core does not limit the router pinned to the first. A request
with `"stream": true` gets one SSE event per token every `--interval-ms` (vLLM 0.33's
completions event shape, token ids when asked, `kv_transfer_params` on the last event),
then `data: [DONE]`; otherwise a JSON answer with one token and `kv_transfer_params`, as a
prefill engine answers. Every GET answers 200 `{}` (health probes, model list).

    python benchmarks/fake_engine.py PORT [--interval-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from typing import Any

MODEL = "fake"
_ids = itertools.count()


def _event(obj: dict[str, Any]) -> bytes:
    data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


class Stream:
    """One streamed answer in progress."""

    __slots__ = ("transport", "left", "n", "rid", "ids", "chat", "prompt", "first")

    def __init__(self, transport: asyncio.Transport, body: dict[str, Any], chat: bool) -> None:
        self.transport = transport
        self.left = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        self.n = 0
        self.rid = f"cmpl-{next(_ids)}"
        self.ids = bool(body.get("return_token_ids"))
        self.chat = chat
        self.prompt = _prompt_ids(body.get("prompt"))
        self.first = True

    def chunk(self) -> bytes:
        """The next token's event (and [DONE] after the last)."""
        self.left -= 1
        self.n += 1
        last = self.left <= 0
        tid = 100 + self.n % 1000
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": f" t{self.n}"},
                                      "logprobs": None,
                                      "finish_reason": "length" if last else None}
        else:
            choice = {"index": 0, "text": f" t{self.n}", "logprobs": None,
                      "finish_reason": "length" if last else None, "stop_reason": None}
        if self.ids:
            choice["token_ids"] = [tid]
            if self.first and self.prompt is not None:
                choice["prompt_token_ids"] = self.prompt
        self.first = False
        obj: dict[str, Any] = {"id": self.rid, "object": "chat.completion.chunk" if self.chat
                               else "text_completion", "created": 1, "model": MODEL,
                               "choices": [choice]}
        if last:
            obj["kv_transfer_params"] = {"remote_engine_id": "fake", "remote_block_ids": [1]}
        out = _event(obj)
        if last:
            out += _event_raw(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        return out


def _prompt_ids(prompt: Any) -> list[int] | None:
    """The prompt's token ids as vLLM reports them (a text prompt: one id per word)."""
    if isinstance(prompt, list):
        return prompt
    return [7] * len(prompt.split()) if isinstance(prompt, str) else None


def _event_raw(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Engine:
    """The streams of all connections, advanced together one token per tick."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.streams: list[Stream] = []

    async def tick(self) -> None:
        nxt = time.monotonic()
        while True:
            nxt += self.interval_s
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            keep = []
            for s in self.streams:
                if s.transport.is_closing():
                    continue
                s.transport.write(s.chunk())
                if s.left > 0:
                    keep.append(s)
            self.streams = keep


class Http(asyncio.Protocol):
    """HTTP/1.1 keep-alive, Content-Length bodies: what routers and clients send."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end].decode("latin-1")
            lines = head.split("\r\n")
            length = 0
            for ln in lines[1:]:
                k, _, v = ln.partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v.strip())
            end = head_end + 4 + length
            if len(self.buf) < end:
                return
            body, self.buf = self.buf[head_end + 4:end], self.buf[end:]
            self.request(lines[0].split(" ")[:2], body)

    def request(self, line: list[str], raw: bytes) -> None:
        assert self.transport is not None
        method, path = line[0], line[1] if len(line) > 1 else "/"
        if method != "POST":
            self.respond(200, b"{}" if path != "/v1/models" else json.dumps(
                {"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode())
            return
        try:
            body = json.loads(raw)
        except ValueError:
            self.respond(400, b'{"error":{"message":"bad json"}}')
            return
        chat = "chat" in path
        if body.get("stream"):
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n")
            self.engine.streams.append(Stream(self.transport, body, chat))
            return
        answer = {"id": f"cmpl-{next(_ids)}", "object": "text_completion", "created": 1,
                  "model": MODEL, "choices": [{"index": 0, "text": " t0", "token_ids": [100],
                                               "finish_reason": "length"}],
                  "prompt_token_ids": _prompt_ids(body.get("prompt")),
                  "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "p",
                                         "remote_block_ids": [1], "remote_host": "127.0.0.1",
                                         "remote_port": 5600}}
        self.respond(200, json.dumps(answer).encode())

    def respond(self, status: int, body: bytes) -> None:
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (status, len(body), body))


async def run(port: int, interval_s: float) -> None:
    engine = Engine(interval_s)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Http(engine), "127.0.0.1", port, backlog=4096)
    async with server:
        await engine.tick()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("--interval-ms", type=float, default=20.0)
    args = ap.parse_args()
    import uvloop

    uvloop.run(run(args.port, args.interval_ms / 1e3))


if __name__ == "__main__":
    main()
