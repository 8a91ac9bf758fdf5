"""Answers as a given vLLM version's OpenAI server sends them, made by that version's own
classes and serializer calls (run with that version's sources first on PYTHONPATH).

`python tests/vllm_answer_shapes.py OFFER_JSON` prints {"chat"|"completions":
{"json": str, "events": [str]}}: a non-streamed answer and the SSE events of a streamed
one, each carrying `OFFER_JSON` as `kv_transfer_params` where that version puts it. The
serializer calls copy vLLM 0.33's (entrypoints/openai/chat_completion/serving.py:
`model_dump_json(exclude_unset=True, exclude_none=not chunk.choices)` per chunk, params
on the chunk with the finish reason; completion/serving.py: `exclude_unset=True`, params
set on every chunk, None until the finish reason).
"""

from __future__ import annotations

import json
import sys

from vllm.entrypoints.openai.chat_completion import protocol as chat
from vllm.entrypoints.openai.completion import protocol as cmpl

TOKENS = ["Hello", " from", " D"]


def chat_answers(offer: dict) -> dict:
    events = []
    first = chat.ChatCompletionStreamResponse(
        id="chatcmpl-1", object="chat.completion.chunk", created=1, model="tiny",
        choices=[chat.ChatCompletionResponseStreamChoice(
            index=0, delta=chat.DeltaMessage(role="assistant", content=""),
            logprobs=None, finish_reason=None)])
    events.append(first.model_dump_json(exclude_unset=True, exclude_none=not first.choices))
    for i, tok in enumerate(TOKENS):
        last = i == len(TOKENS) - 1
        chunk = chat.ChatCompletionStreamResponse(
            id="chatcmpl-1", object="chat.completion.chunk", created=1, model="tiny",
            choices=[chat.ChatCompletionResponseStreamChoice(
                index=0, delta=chat.DeltaMessage(content=tok), logprobs=None,
                finish_reason="length" if last else None)],
            kv_transfer_params=offer if last else None)
        events.append(chunk.model_dump_json(exclude_unset=True, exclude_none=not chunk.choices))
    answer = chat.ChatCompletionResponse(
        id="chatcmpl-1", created=1, model="tiny",
        choices=[chat.ChatCompletionResponseChoice(
            index=0, message=chat.ChatMessage(role="assistant", content="".join(TOKENS)),
            finish_reason="length")],
        usage=chat.UsageInfo(prompt_tokens=3, completion_tokens=3, total_tokens=6),
        kv_transfer_params=offer)
    return {"json": answer.model_dump_json(), "events": events}


def completion_answers(offer: dict) -> dict:
    events = []
    for i, tok in enumerate(TOKENS):
        last = i == len(TOKENS) - 1
        chunk = cmpl.CompletionStreamResponse(
            id="cmpl-1", created=1, model="tiny",
            choices=[cmpl.CompletionResponseStreamChoice(
                index=0, text=tok, logprobs=None, finish_reason="length" if last else None)],
            kv_transfer_params=offer if last else None)
        events.append(chunk.model_dump_json(exclude_unset=True))
    answer = cmpl.CompletionResponse(
        id="cmpl-1", created=1, model="tiny",
        choices=[cmpl.CompletionResponseChoice(index=0, text="".join(TOKENS),
                                               finish_reason="length")],
        usage=cmpl.UsageInfo(prompt_tokens=3, completion_tokens=3, total_tokens=6),
        kv_transfer_params=offer)
    return {"json": answer.model_dump_json(), "events": events}


if __name__ == "__main__":
    offer = json.loads(sys.argv[1])
    print(json.dumps({"chat": chat_answers(offer), "completions": completion_answers(offer),
                      "vllm_file": chat.__file__}))
