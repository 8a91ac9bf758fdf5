"""Prime vLLM's incremental detokenizer with the prompt's tail, not the whole prompt.

Every vLLM from 0.21 to 0.33 builds a request's ``FastIncrementalDetokenizer`` with
``tokenizers.decoders.DecodeStream(ids=request.prompt_token_ids)``
(``vllm/v1/engine/detokenizer.py``). The stream's first ``step()`` then decodes the whole
prompt plus the first token to find where the new text begins, in the API server's event
loop, before the first chunk goes out: ~9 ms for 16k random ids with the tiny test
tokenizer here, 14-44 ms measured on the H200 host for the benchmark's 16k prompts, on every
request's TTFT, colocated or not, and on D's handoff after every transfer (README, "Every
millisecond of a push request"). The later steps cost microseconds.

The prompt matters to the first tokens' text only where the two meet: a character whose
bytes span tokens, or a decoder that treats the string's first token apart (SentencePiece's
leading space). `install` wraps ``FastIncrementalDetokenizer.__init__``: the stream starts
empty and is stepped through the prompt's last ``window`` ids (moved back to a character's
first byte, `tail_start`), as if they had been generated. vLLM's own slow detokenizer
primes with 7 prompt tokens (``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET`` + 2 in
``vllm/tokenizers/detokenizer_utils.py``). tests/test_detokenizer_window.py shows the text
equals a stream stepped through the whole prompt, and vLLM's own wherever the prompt's text
ends on a whole character; where it ends inside one, vLLM's priming streams the whole
prompt's text again with the first token, and this streams the new characters only.

Opt-in per process: vLLM loads kvferry's plugin in every process it starts (plugin.py),
and this runs only where ``KVFERRY_DETOKENIZE_WINDOW`` is set, so an engine kvferry did
not launch is unaffected. Every engine kvferry launches gets it (scripts/engines.py);
``KVFERRY_DETOKENIZE_WINDOW=0`` in the launcher's environment turns it off.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Sequence
from typing import Any

ENV = "KVFERRY_DETOKENIZE_WINDOW"
DEFAULT_WINDOW = 32
MIN_WINDOW = 8  # above vLLM's slow path (7) and a UTF-8 character's 4 byte tokens
CONTINUATION_BYTE = re.compile(r"<0x[89AB][0-9A-F]>")  # byte fallback's 0x80-0xBF

METRIC = "kvferry_detokenize_window_tokens"

_installed: int | None = None
_gauge: Any = None


def installed() -> int | None:
    """The window this process's detokenizer is primed with, None if not installed."""
    return _installed


def window_from_env(environ: dict[str, str] | None = None) -> int | None:
    """The window ``KVFERRY_DETOKENIZE_WINDOW`` asks for: None if unset or 0 (off)."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not raw:
        return None
    try:
        window = int(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: expected a number of prompt tokens") from None
    if window == 0:
        return None
    if window < MIN_WINDOW:
        raise ValueError(f"{ENV}={window}: at least {MIN_WINDOW} prompt tokens (0 turns it off)")
    return window


class _NoPrompt:
    """The request as ``FastIncrementalDetokenizer.__init__`` reads it, with no prompt
    ids to prime with. A view, so the class of vLLM's request does not matter."""

    __slots__ = ("_request", "prompt_token_ids")

    def __init__(self, request: Any) -> None:
        self._request = request
        self.prompt_token_ids: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


def tail_start(tokenizer: Any, ids: Sequence[int], window: int) -> int:
    """Where the priming starts: ``window`` ids from the end, moved back over up to 3
    UTF-8 continuation bytes in SentencePiece's byte-fallback form (``<0x80>`` to
    ``<0xBF>``). Byte fallback turns a whole run of byte tokens that is not valid UTF-8
    into U+FFFD, so a stream primed inside a character's bytes would emit nothing until
    the run ends. Byte-level BPE (GPT-2, Qwen, Llama 3) shows stray leading bytes as
    U+FFFD on their own, in the primed text only, and needs no move."""
    start = max(len(ids) - window, 0)
    for _ in range(3):  # a UTF-8 character has at most 3 continuation bytes
        token = tokenizer.id_to_token(ids[start]) if start > 0 else None
        if token is None or not CONTINUATION_BYTE.fullmatch(token):
            break
        start -= 1
    return start


def install(window: int) -> None:
    """Wrap this process's ``FastIncrementalDetokenizer.__init__`` (idempotent)."""
    global _installed
    if window < MIN_WINDOW:
        raise ValueError(f"detokenizer window {window} < {MIN_WINDOW}")
    import tokenizers.decoders
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer as cls

    init = getattr(cls.__init__, "__wrapped__", cls.__init__)

    @functools.wraps(init)
    def primed_with_tail(self: Any, tokenizer: Any, request: Any) -> None:
        ids = request.prompt_token_ids
        if ids is None:  # prompt embeddings: nothing to prime with
            return init(self, tokenizer, request)
        init(self, tokenizer, _NoPrompt(request))
        try:
            for tid in ids[tail_start(self.tokenizer, ids, window):]:
                self.stream.step(self.tokenizer, tid)
        except Exception:  # noqa: BLE001 - vLLM's own recovery: an unprimed stream
            self.stream = tokenizers.decoders.DecodeStream(
                skip_special_tokens=self.skip_special_tokens)

    cls.__init__ = primed_with_tail
    _installed = window
    _export(window)


def _export(window: int) -> None:
    """On the API server's /metrics (vLLM serves prometheus_client's registry), so an
    operator, and the end-to-end tests, can see the engine runs with it."""
    global _gauge
    if _gauge is None:
        from prometheus_client import Gauge

        _gauge = Gauge(METRIC, "Prompt tokens vLLM's incremental detokenizer is primed with "
                       "(kvferry; absent: the whole prompt)", multiprocess_mode="max")
    _gauge.set(window)


def install_from_env() -> int | None:
    window = window_from_env()
    if window is not None:
        install(window)
    return window
