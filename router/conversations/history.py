"""What the router knows of a conversation's history, without a tokenizer or a round trip.

A request's prompt is viewed as one of: chat messages, a text prompt, token ids, or
something else. For chat, each message is normalised (the fields a chat template renders:
role, content, name, tool calls, tool call id; `None`, empty and unknown fields dropped,
text-only content parts joined) and chained into digests: digest ``i`` covers messages
``[0, i]`` plus the body fields that change how the template renders them (model, tools,
chat template and its kwargs), so equal digests mean the same rendered prefix.

After a turn, a *record* of what D now holds (the request's messages plus the answer the
router passed back) is stored with the conversation's entry:
``{"kind": "chat", "digest", "messages", "chars", "tokens"}`` (``tokens``: the turn's
prompt + completion tokens when D reported usage, else absent). The next request is a
continuation of that record iff its chain has the record's digest at the record's length
(`delta`); the messages beyond it are the new part, counted in characters.

Token-id prompts need none of this: the entry's lease offer carries D's block hash chain,
which the request's tokens are matched against exactly (`turn_policy.new_tokens`).

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..wire import bodies

ROOT = b"kvferry-history-v1"
RENDER_FIELDS = ("model", "tools", "chat_template", "chat_template_kwargs", "documents",
                 "add_generation_prompt", "continue_final_message")
"""Body fields a chat template renders besides the messages (a change means another
prompt even for the same messages)."""
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")
CONTENT_KEY_PREFIX = "\x00h:"
"""Registry keys of content-matched conversations: an explicit id is printable
(`registry._clean_id`), so it can never equal one."""
MAX_CANDIDATES = 3
"""Assistant-ending prefixes of a request looked up as content keys, longest first."""

Kind = Literal["chat", "text", "tokens", "other"]


@dataclass(frozen=True)
class PromptView:
    """A request's prompt as the router sees it."""

    kind: Kind
    digests: tuple[str, ...] = ()  # chat: digest of messages[: i + 1]
    chars: tuple[int, ...] = ()  # chat: characters of messages[: i + 1]
    roles: tuple[str, ...] = ()
    text: str = ""  # text completions
    tokens: tuple[int, ...] = ()  # token-id completions
    choices: int = 1  # `n`: a continuation can only follow a single answer

    @property
    def messages(self) -> int:
        return len(self.digests)


@dataclass(frozen=True)
class Answer:
    """What the router passed back for one turn (choice 0)."""

    text: str = ""
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    tokens: int | None = None  # usage: prompt + completion tokens, when D reported it


@dataclass(frozen=True)
class Delta:
    """The part of a request beyond the history its conversation's D holds."""

    chars: int
    messages: int


def _canon(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str).encode()


def _step(prev: bytes, item: bytes) -> bytes:
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(len(item).to_bytes(8, "little"))
    h.update(item)
    return h.digest()


def _content(value: Any) -> Any:
    """Text-only part lists become one string (clients resend either form)."""
    if isinstance(value, list) and all(
            isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in value):
        return "\n".join(p["text"] for p in value)
    return value


def _tool_calls(value: Any) -> Any:
    if not isinstance(value, list):
        return value
    out = []
    for call in value:
        if not isinstance(call, Mapping):
            out.append(call)
            continue
        fn = call.get("function") if isinstance(call.get("function"), Mapping) else {}
        out.append({"id": call.get("id"), "type": call.get("type") or "function",
                    "function": {"name": fn.get("name"), "arguments": fn.get("arguments") or ""}})
    return out


def normalise(message: Any) -> dict[str, Any] | None:
    """The rendered fields of one chat message, or None if it is not a message object."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        return None
    out: dict[str, Any] = {}
    for k in MESSAGE_FIELDS:
        v = message.get(k)
        if k == "content":
            v = _content(v)
        elif k == "tool_calls":
            v = _tool_calls(v)
        if v is None or v == "" or v == []:
            continue
        out[k] = v
    return out


def message_chars(message: Mapping[str, Any]) -> int:
    """Characters a message contributes to the prompt (its text, tool names and arguments)."""
    n = 0
    content = message.get("content")
    if isinstance(content, str):
        n += len(content)
    elif content is not None:
        n += len(_canon(content))
    for call in message.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(fn, Mapping):
            n += len(str(fn.get("name") or "")) + len(str(fn.get("arguments") or ""))
    return n


def _root(body: Mapping[str, Any]) -> bytes:
    return _step(ROOT, _canon({k: body.get(k) for k in RENDER_FIELDS if body.get(k) is not None}))


def _choices(body: Mapping[str, Any]) -> int:
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def view_of(body: Mapping[str, Any]) -> PromptView:
    """The request's prompt: chat messages, a text prompt, token ids, or other."""
    n = _choices(body)
    messages = body.get("messages")
    if isinstance(messages, list):
        norm = [normalise(m) for m in messages]
        if not norm or any(m is None for m in norm):
            return PromptView("other", choices=n)
        prev, total = _root(body), 0
        digests, chars, roles = [], [], []
        for m in norm:
            assert m is not None
            prev = _step(prev, _canon(m))
            total += message_chars(m)
            digests.append(prev.hex())
            chars.append(total)
            roles.append(m["role"])
        return PromptView("chat", tuple(digests), tuple(chars), tuple(roles), choices=n)
    p = body.get("prompt")
    if isinstance(p, str):
        return PromptView("text", text=p, choices=n)
    if (ids := bodies.token_ids(p)) is not None:
        return PromptView("tokens", tokens=tuple(ids), choices=n)
    return PromptView("other", choices=n)


def answer_message(answer: Answer) -> dict[str, Any] | None:
    return normalise({"role": "assistant", "content": answer.text,
                      "tool_calls": list(answer.tool_calls) or None})


def _text_digest(text: str) -> str:
    return _step(ROOT + b"text", text.encode()).hex()


def record(view: PromptView, answer: Answer) -> dict[str, Any] | None:
    """What D holds after this turn (the request plus its answer), or None when the
    router cannot tell (several choices, a prompt it does not follow)."""
    if view.choices != 1:
        return None
    tokens = {"tokens": answer.tokens} if answer.tokens is not None and answer.tokens > 0 else {}
    if view.kind == "chat":
        msg = answer_message(answer)
        if msg is None or not view.digests:
            return None
        digest = _step(bytes.fromhex(view.digests[-1]), _canon(msg)).hex()
        return {"kind": "chat", "digest": digest, "messages": view.messages + 1,
                "chars": view.chars[-1] + message_chars(msg), **tokens}
    if view.kind == "text":
        full = view.text + answer.text
        return {"kind": "text", "digest": _text_digest(full), "chars": len(full), **tokens}
    return None


def delta(rec: Mapping[str, Any] | None, view: PromptView) -> Delta | None:
    """The part of `view` beyond the recorded history, or None when `view` does not start
    with exactly that history (edited, forked before it, another prompt kind)."""
    if not isinstance(rec, Mapping) or rec.get("kind") != view.kind:
        return None
    chars = rec.get("chars")
    if not isinstance(chars, int) or chars < 0:
        return None
    if view.kind == "chat":
        n = rec.get("messages")
        if not isinstance(n, int) or not 0 < n <= view.messages:
            return None
        if view.digests[n - 1] != rec.get("digest"):
            return None
        return Delta(view.chars[-1] - view.chars[n - 1], view.messages - n)
    if view.kind == "text":
        if len(view.text) < chars or _text_digest(view.text[:chars]) != rec.get("digest"):
            return None
        return Delta(len(view.text) - chars, 0)
    return None


def printable(conversation_id: str) -> str:
    """A conversation id as logs show it: a content key without its NUL (logs are text;
    grep treats a file with NUL bytes as binary)."""
    if conversation_id.startswith(CONTENT_KEY_PREFIX):
        return "content:" + conversation_id[len(CONTENT_KEY_PREFIX):]
    return conversation_id


def content_key(rec: Mapping[str, Any]) -> str:
    """The registry key of a content-matched conversation whose history is `rec`."""
    return CONTENT_KEY_PREFIX + str(rec["digest"])


def candidate_keys(view: PromptView, limit: int = MAX_CANDIDATES) -> list[str]:
    """Content keys this request may continue: its prefixes that end with an assistant
    message (where a recorded turn ends), longest first."""
    if view.kind != "chat" or view.choices != 1:
        return []
    out = [CONTENT_KEY_PREFIX + d for d, role in zip(reversed(view.digests), reversed(view.roles),
                                                      strict=True) if role == "assistant"]
    return out[:limit]

