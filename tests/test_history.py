"""router/conversations/history.py: how the router follows a chat history without a tokenizer (pure)."""

from __future__ import annotations

from kvferry.router.conversations.history import (
    CONTENT_KEY_PREFIX,
    Answer,
    Delta,
    candidate_keys,
    content_key,
    delta,
    normalise,
    record,
    view_of,
)

SYS = {"role": "system", "content": "You are terse."}
U1 = {"role": "user", "content": "What is a ferry?"}
A1 = Answer("A boat that carries things across water.")
U2 = {"role": "user", "content": "And a KV cache?"}


def chat(*messages: dict, **extra) -> dict:
    return {"model": "m", "messages": list(messages), **extra}


def assistant(answer: Answer, **extra) -> dict:
    return {"role": "assistant", "content": answer.text, **extra}


def test_normalise_keeps_what_a_template_renders():
    sdk_style = {"role": "assistant", "content": "hi", "refusal": None, "annotations": [],
                 "audio": None, "function_call": None, "tool_calls": None,
                 "reasoning_content": "thinking..."}
    assert normalise(sdk_style) == {"role": "assistant", "content": "hi"}
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert normalise(parts) == {"role": "user", "content": "a\nb"}
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    assert normalise(image)["content"] == image["content"]  # kept as is, still comparable
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}, "index": 0}]}
    assert normalise(call) == {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert normalise({"content": "no role"}) is None and normalise("text") is None


def test_views_by_prompt_kind():
    assert view_of(chat(SYS, U1)).kind == "chat"
    assert view_of({"prompt": "once upon"}).kind == "text"
    assert view_of({"prompt": [1, 2, 3]}).tokens == (1, 2, 3)
    for odd in ({"prompt": [[1, 2]]}, {"prompt": [True]}, {"messages": []},
                {"messages": [{"content": "x"}]}, {}):
        assert view_of(odd).kind == "other", odd
    v = view_of(chat(SYS, U1))
    assert v.roles == ("system", "user") and v.chars == (len(SYS["content"]),
                                                          len(SYS["content"]) + len(U1["content"]))


def test_digests_chain_messages_and_rendering_fields():
    base = view_of(chat(SYS, U1)).digests
    assert view_of(chat(SYS, U1, U2)).digests[:2] == base  # a prefix keeps its digests
    assert view_of(chat({**SYS, "content": "You are kind."}, U1)).digests[0] != base[0]
    assert view_of(chat(U1, SYS)).digests[1] != base[1]  # order matters
    for extra in ({"tools": [{"type": "function", "function": {"name": "f"}}]},
                  {"chat_template_kwargs": {"enable_thinking": False}}, {"model": "other"}):
        assert view_of(chat(SYS, U1, **extra)).digests[0] != base[0], extra
    # Fields that do not change the rendered prompt do not matter.
    assert view_of(chat(SYS, U1, temperature=0.3, max_tokens=9, stream=True)).digests == base


def test_a_continuation_matches_its_record():
    rec = record(view_of(chat(SYS, U1)), A1)
    assert rec is not None and rec["messages"] == 3
    nxt = view_of(chat(SYS, U1, assistant(A1), U2))
    assert delta(rec, nxt) == Delta(len(U2["content"]), 1)
    # The SDK resending the answer object (extra None fields, parts) is the same history.
    sdk = {"role": "assistant", "content": [{"type": "text", "text": A1.text}], "refusal": None}
    assert delta(rec, view_of(chat(SYS, U1, sdk, U2))) == Delta(len(U2["content"]), 1)
    # Exactly the history, nothing new (e.g. a retry after the client timed out).
    assert delta(rec, view_of(chat(SYS, U1, assistant(A1)))) == Delta(0, 0)
    assert candidate_keys(nxt)[0] == content_key(rec)


def test_edits_forks_and_other_answers_do_not_match():
    rec = record(view_of(chat(SYS, U1)), A1)
    edits = [
        chat({**SYS, "content": "You are verbose."}, U1, assistant(A1), U2),  # system edited
        chat(SYS, {**U1, "content": "What is a raft?"}, assistant(A1), U2),  # question edited
        chat(SYS, U1, assistant(Answer("Another answer.")), U2),  # answer edited or regenerated
        chat(SYS, U1, U2),  # answer dropped
        chat(SYS, U1),  # the same first turn again (a regenerate): not a continuation
        chat(SYS, U1, assistant(A1), U2, tools=[{"type": "function", "function": {"name": "f"}}]),
    ]
    for body in edits:
        v = view_of(body)
        assert delta(rec, v) is None, body
        assert content_key(rec) not in candidate_keys(v), body
    # A fork: two different follow-ups of the same turn both continue it.
    for follow in (U2, {"role": "user", "content": "Something else entirely."}):
        assert delta(rec, view_of(chat(SYS, U1, assistant(A1), follow))) is not None
    # Records of another prompt kind or malformed ones never match.
    assert delta({**rec, "kind": "text"}, view_of(chat(SYS, U1, assistant(A1), U2))) is None
    for bad in (None, {}, {**rec, "messages": 0}, {**rec, "messages": 99}, {**rec, "chars": -1}):
        assert delta(bad, view_of(chat(SYS, U1, assistant(A1), U2))) is None


def test_tool_call_answers_continue():
    call = {"id": "call-1", "type": "function", "function": {"name": "lookup", "arguments": '{"q":1}'}}
    rec = record(view_of(chat(SYS, U1)), Answer("", (call,)))
    tool = {"role": "tool", "tool_call_id": "call-1", "content": "42"}
    resent = {"role": "assistant", "content": None, "tool_calls": [call]}
    assert delta(rec, view_of(chat(SYS, U1, resent, tool))) == Delta(2, 1)
    wrong_args = {**call, "function": {"name": "lookup", "arguments": '{"q":2}'}}
    assert delta(rec, view_of(chat(SYS, U1, {**resent, "tool_calls": [wrong_args]}, tool))) is None


def test_candidates_are_assistant_prefixes_longest_first():
    a2 = Answer("Blocks of attention state.")
    v = view_of(chat(SYS, U1, assistant(A1), U2, assistant(a2), {"role": "user", "content": "ok"}))
    keys = candidate_keys(v)
    assert keys == [CONTENT_KEY_PREFIX + v.digests[4], CONTENT_KEY_PREFIX + v.digests[2]]
    assert candidate_keys(v, limit=1) == keys[:1]
    assert candidate_keys(view_of(chat(SYS, U1))) == []
    assert candidate_keys(view_of(chat(SYS, U1, assistant(A1), U2, n=2))) == []
    assert all(not k.isprintable() for k in keys)  # never equal to an explicit id


def test_records_need_one_choice_and_a_followable_prompt():
    assert record(view_of(chat(SYS, U1, n=3)), A1) is None
    assert record(view_of({"prompt": [1, 2]}), A1) is None
    assert record(view_of({"messages": "x"}), A1) is None
    rec = record(view_of(chat(SYS, U1)), Answer("x", (), tokens=57))
    assert rec is not None and rec["tokens"] == 57
    assert "tokens" not in record(view_of(chat(SYS, U1)), Answer("x"))


def test_text_prompts():
    rec = record(view_of({"prompt": "Once upon a time"}), Answer(", a ferry."))
    assert rec is not None and rec["chars"] == len("Once upon a time, a ferry.")
    assert delta(rec, view_of({"prompt": "Once upon a time, a ferry. Then"})) == Delta(5, 0)
    assert delta(rec, view_of({"prompt": "Once upon a time, a raft. Then"})) is None
    assert delta(rec, view_of({"prompt": "Once"})) is None
    assert candidate_keys(view_of({"prompt": "Once upon a time, a ferry."})) == []  # chat only
