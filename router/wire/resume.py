"""Continuing a client stream on another engine pair, the event side: D's events recorded
(`resume_request.Progress`: the token ids that reached the client) and rewritten to look
like the rest of the client's stream. No I/O (`migrate.py` runs it).

The client's own view is kept: token id fields D returns only because the router asked
are set back to null (as D writes them when not asked), a chat client gets chat chunks,
the continuation's events carry the first stream's id and `created`, usage counts the
original prompt and every generated token, and logprob text offsets keep counting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from . import bodies
from .resume_request import Progress
from .sse_filters import EngineFieldFilter
from .sse_framing import TokenShape, event_ends, last_event_end, plain_token_ids

_DONE = b"data: [DONE]"


class EventRewriter:
    """A ChunkFilter over one engine's SSE answer: records what passes (`Progress`) and
    rewrites each event to the client's view. `offset` None: the stream's first answer,
    in the client's own format; else a completions continuation that started after
    `offset` sent tokens. An error event ends the answer (`broken`): it and everything
    after it are dropped, so another engine can take over."""

    def __init__(self, progress: Progress, offset: int | None = None,
                 then: EngineFieldFilter | None = None) -> None:
        self.p = progress
        self.offset = offset
        self.then = then
        """What the rewritten bytes go through next; skipped for a plain token event it
        `passes` (one filter's work per token, not two)."""
        self._text_base = progress.text_chars
        self._held = b""
        self.done = False
        self.error: str | None = None
        self._skip: tuple[int, str] | None = None  # P's token 1, still to drop from D's
        self._spliced = False
        self._on_splice: Callable[[bool], None] | None = None
        self.mismatch = False
        """D's token 1 was not P's (`splice`): D is fine, only this stream must move."""
        self._fast = True
        """Plain token events may skip parsing (`_plain_token`); off once an event carries
        logprobs, whose text offsets need every event's text counted."""
        self._shape: TokenShape | None = None
        """This stream's plain token events, once one was seen whole (`feed`); dropped by
        anything that ends the plain path (`splice`, an error event)."""

    def splice(self, token_id: int, text: str,
               on_result: Callable[[bool], None] | None = None) -> None:
        """P's token 1 (router/legs/first_token.py) went to the client through this filter, as
        the stream's first event: drop D's own token 1 (and a chat stream's role-only
        event) from D's events, which then carry the first event's id and `created`. A D
        whose token 1 is another token, or renders to other text, breaks the leg
        (`mismatch`), and the stream moves on from prompt + P's token. ``on_result``:
        called once with whether D's token 1 matched."""
        self._skip = (token_id, text)
        self._spliced = True
        self._shape = None
        self._on_splice = on_result

    def broken(self) -> str | None:
        """After the engine's answer ended: why it is incomplete, or None."""
        if self.mismatch:
            return f"gave another token 1 than P's, which the client has: {self.error}"
        if self.error is not None:
            return f"sent an error event: {self.error}"
        return None if self.done else "ended before [DONE]"

    def feed(self, chunk: bytes) -> bytes:
        shape = self._shape
        if shape is not None and not self._held and (hit := shape.match(chunk)) is not None:
            # The token path: an event shaped as one `then` passed (it holds nothing:
            # it is fed whole events only).
            token, start, end = hit
            p = self.p
            p.sent.append(token)
            p.events += 1
            return chunk if p.want_ids else chunk[:start] + b'"token_ids":null' + chunk[end:]
        then = self.then
        if (not self._held and self.error is None and chunk.endswith(b"\n\n")
                and chunk.find(b"\n\n") == len(chunk) - 2 and b"\r" not in chunk):
            # One whole event, as vLLM sends them: a plain token is handled with its
            # blank line (no slicing it off and adding it back).
            if self._fast and self.offset is None and not self._spliced and self.p.id is not None:
                fast = self._plain_token(chunk, learn=True)
                if fast is not None:
                    return fast if then is None or then.passes(fast) else then.feed(fast)
            out = self._event(chunk[:-2], b"\n\n")
        else:
            data = self._held + chunk
            end = last_event_end(data)
            self._held = data[end:]
            out = self._events(data[:end])
        return out if then is None else then.feed(out)

    def flush(self) -> bytes:
        out, self._held = self._held, b""
        out = self._events(out)
        if self.then is None:
            return out
        return self.then.feed(out) + self.then.flush() if out else self.then.flush()

    def _events(self, data: bytes) -> bytes:
        if not data or self.error is not None:
            return b""
        out = []
        pos = 0
        for start, end in event_ends(data):
            out.append(self._event(data[pos:start], data[start:end]))
            pos = end
        if pos < len(data):
            out.append(self._event(data[pos:], b""))
        return b"".join(out)

    def _event(self, event: bytes, sep: bytes) -> bytes:
        if self.error is not None:
            return b""
        if self._fast and self.offset is None and not self._spliced and self.p.id is not None:
            fast = self._plain_token(event)
            if fast is not None:
                return fast + sep
        if event.startswith(_DONE):
            self.done = True
            return event + sep
        if not event.startswith(b"data:"):
            return event + sep
        try:
            obj = msgspec.json.decode(event[5:].strip())
        except msgspec.DecodeError:
            return event + sep
        if not isinstance(obj, dict):
            return event + sep
        if "error" in obj or obj.get("object") == "error":
            err = obj.get("error", obj)
            self.error = str(err.get("message") if isinstance(err, dict) else err)[:300]
            self._shape = None
            return b""
        changed = False
        if self._spliced and self.offset is None:
            changed = self._as_stream(obj)
            if self._skip is not None:
                if not self._drop_token_one(obj):
                    return b""  # D's token 1 (or its role event), or a mismatch
                changed = True
        changed |= self._first(obj) if self.offset is None else self._continued(obj)
        self.p.events += 1
        return (b"data: " + msgspec.json.encode(obj) if changed else event) + sep

    def _plain_token(self, event: bytes, learn: bool = False) -> bytes | None:
        """A plain token event handled on its bytes (`plain_token_ids`): its ids recorded
        and, unless the client asked for them, nulled; None when it needs parsing.
        `learn`: `event` is one whole event, whose shape the next ones may match."""
        found = plain_token_ids(event)
        if found is None:
            return None
        ids, start, end = found
        if (learn and self._shape is None and len(ids) == 1
                and (self.then is None or self.then.passes(event))):
            self._shape = TokenShape.of(event, (start, end))
        self.p.sent.extend(ids)
        self.p.events += 1
        return event if self.p.want_ids else event[:start] + b'"token_ids":null' + event[end:]

    # -- the stream's first answer: record, null what the client did not ask for -----------
    def _first(self, obj: dict[str, Any]) -> bool:
        p = self.p
        if p.id is None:
            p.id, p.created, p.model = obj.get("id"), obj.get("created"), obj.get("model")
        changed = self._take_ids(obj, "prompt_token_ids", prompt=True)
        for choice in _choices(obj):
            changed |= self._take_ids(choice, "prompt_token_ids", prompt=True)
            changed |= self._take_ids(choice, "token_ids", prompt=False)
            delta = choice.get("delta")
            if isinstance(delta, dict) and delta.get("role"):
                p.role_sent = True
            if isinstance(text := choice.get("text"), str):
                p.text_chars += len(text)
            if choice.get("logprobs") is not None:
                self._fast = False
                self._shape = None
            if choice.get("finish_reason") is not None:
                p.finished = True
        return changed

    # -- P's token 1 went first (splice) ------------------------------------------------------
    def _as_stream(self, obj: dict[str, Any]) -> bool:
        """D's event under the id and `created` of the stream's first event (P's)."""
        changed = False
        for key in ("id", "created"):
            want = getattr(self.p, key)
            if want is not None and obj.get(key) != want:
                obj[key] = want
                changed = True
        return changed

    def _drop_token_one(self, obj: dict[str, Any]) -> bool:
        """Remove D's token 1 from this event; False: drop the whole event."""
        assert self._skip is not None
        token_id, text = self._skip
        choices = _choices(obj)
        for holder in (obj, *choices):  # the prompt, in case the stream must move; the
            self._take_ids(holder, "prompt_token_ids", prompt=True)  # client had it first
            if holder.get("prompt_token_ids") is not None:
                holder["prompt_token_ids"] = None
        if not choices:  # usage only: nothing of token 1 here
            return True
        choice = choices[0]
        delta = choice.get("delta")
        holder = delta if isinstance(delta, dict) else choice
        key = "content" if isinstance(delta, dict) else "text"
        got, ids = holder.get(key), choice.get("token_ids")
        if not ids:
            if (isinstance(delta, dict) and delta.get("role") and not got
                    and choice.get("finish_reason") is None):
                return False  # D's role event: P's event carried the role
            return self._mismatch("D's first token event carries no token ids")
        other = isinstance(delta, dict) and (delta.get("tool_calls") or any(
            delta.get(k) for k in ("reasoning", "reasoning_content")))
        if ids[0] != token_id or not isinstance(got, str) or not got.startswith(text) or other:
            return self._mismatch(f"D's token 1 is {ids[0]} ({got!r}), P's {token_id} ({text!r})")
        self._skip = None
        choice["token_ids"], holder[key] = ids[1:], got[len(text):]
        if self._on_splice is not None:
            self._on_splice(True)
        return bool(ids[1:] or holder[key] or choice.get("finish_reason") is not None
                    or obj.get("usage"))

    def _mismatch(self, why: str) -> bool:
        self.error, self.mismatch, self._skip = why, True, None
        if self._on_splice is not None:
            self._on_splice(False)
        return False

    def _take_ids(self, obj: dict[str, Any], key: str, prompt: bool) -> bool:
        ids = obj.get(key)
        if not isinstance(ids, list):
            return False
        if prompt:
            if self.p.prompt_ids is None:
                self.p.prompt_ids = list(ids)
        else:
            self.p.sent.extend(ids)
        if self.p.want_ids:
            return False
        obj[key] = None
        return True

    # -- a continuation: completions events in the client's format --------------------------
    def _continued(self, obj: dict[str, Any]) -> bool:
        p = self.p
        assert self.offset is not None
        obj["id"] = p.id if p.id is not None else obj.get("id")
        if p.created is not None:
            obj["created"] = p.created
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            usage["prompt_tokens"] -= self.offset
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + self.offset
        choices = []
        for choice in _choices(obj):
            if "prompt_token_ids" in choice:  # prompt + sent: the client had the prompt's
                choice["prompt_token_ids"] = None
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                p.sent.extend(ids)
                if not p.want_ids:
                    choice["token_ids"] = None
            text = choice.get("text") if isinstance(choice.get("text"), str) else ""
            self._shift_offsets(choice)
            p.text_chars += len(text)
            if choice.get("finish_reason") is not None:
                p.finished = True
            choices.append(self._as_chat(choice, text) if p.endpoint == bodies.CHAT else choice)
        if "choices" in obj:
            obj["choices"] = choices
        if p.endpoint == bodies.CHAT:
            obj["object"] = "chat.completion.chunk"
        return True

    def _shift_offsets(self, choice: dict[str, Any]) -> None:
        lp = choice.get("logprobs")
        if isinstance(lp, dict) and isinstance(lp.get("text_offset"), list):
            lp["text_offset"] = [o + self._text_base for o in lp["text_offset"]]

    def _as_chat(self, choice: dict[str, Any], text: str) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": text}
        if not self.p.role_sent:
            delta = {"role": "assistant", **delta}
            self.p.role_sent = True
        out = {"index": choice.get("index", 0), "delta": delta, "logprobs": None,
               "finish_reason": choice.get("finish_reason")}
        for key in ("stop_reason", "token_ids"):
            if key in choice:
                out[key] = choice[key]
        return out


def _choices(obj: dict[str, Any]) -> list[dict[str, Any]]:
    choices = obj.get("choices")
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []
