"""The detokenizer primed with the prompt's tail streams the text a stream stepped
through the whole prompt streams, and what vLLM's whole-prompt priming streams wherever the
prompt's text ends on a whole character (connectors/detokenizer_window.py).

vLLM's real ``IncrementalDetokenizer`` and real ``tokenizers`` decoders run on the same
prompts and outputs: the tiny model's byte-level BPE (Qwen's kind) and a SentencePiece-
style tokenizer with byte fallback whose decoder strips the string's first space (Llama
2's kind); every cut of multilingual texts (so prompts end and windows start inside
characters) and random ids; special tokens skipped and kept.

Where the prompt's text ends inside a character (a token-id prompt cut mid-character),
vLLM 0.32's whole-prompt priming streams the whole prompt's text with the first token
('naïve caf' + 0xC3, then 0xA9 streams 'naïve café'); the tail-primed stream gives 'é',
as a stream stepped through the prompt does.
"""

from __future__ import annotations

import json
import random

import pytest
import tokenizers.decoders
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from vllm import SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer, IncrementalDetokenizer

from kvferry.connectors import detokenizer_window as dw
from kvferry.scripts.engines import EngineSpec, engine_env
from kvferry.scripts.modelgen import write_model

TEXTS = (
    "The quick brown fox jumps over the lazy dog. " * 3,
    "naïve café déjà vu, Ærøskøbing, Ελληνικά, русский текст",
    "中文分词测试，日本語のテキスト、한국어 문장입니다",
    "emoji 🚀🔥👩‍👩‍👧 and math ∑∫√ and \t tabs \n newlines",
)
WINDOW = dw.MIN_WINDOW


@pytest.fixture
def restore(monkeypatch):
    """Undo `install` after the test: the class's __init__ and the module's record."""
    monkeypatch.setattr(FastIncrementalDetokenizer, "__init__", FastIncrementalDetokenizer.__init__)
    monkeypatch.setattr(dw, "_installed", None)


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(write_model(tmp_path_factory.mktemp("tiny"), "tiny"))


@pytest.fixture(scope="module")
def llama_like(tmp_path_factory) -> PreTrainedTokenizerFast:
    """Char-level BPE with byte fallback and Llama 2's decoder sequence (its tokenizer.json:
    Replace('▁', ' '), ByteFallback, Fuse, Strip(' ', 1, 0))."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for ch in "▁abcdefghijklmnopqrstuvwxyzTHEQ.,":
        vocab.setdefault(ch, len(vocab))
    vocab["<s>"], vocab["</s>"] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    d = tmp_path_factory.mktemp("llama_like")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
    return AutoTokenizer.from_pretrained(str(d))


def stream(tokenizer, prompt: list[int], outputs: list[int], skip_special: bool) -> list[str]:
    """Each step's new text, as vLLM's output processor builds it, one token per step."""
    req = EngineCoreRequest(
        request_id="r", prompt_token_ids=list(prompt), mm_features=None,
        sampling_params=SamplingParams(max_tokens=len(outputs), skip_special_tokens=skip_special),
        pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None,
        data_parallel_rank=None)
    detok = IncrementalDetokenizer.from_new_request(tokenizer, req)
    assert isinstance(detok, FastIncrementalDetokenizer)
    deltas = []
    for tid in outputs:
        detok.update([tid], stop_terminated=False)
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    return deltas


def cases(tokenizer, rng: random.Random, n_random: int, first_id: int = 0
          ) -> list[tuple[list[int], list[int]]]:
    """(prompt, outputs): every cut of each text's ids, and random ids from first_id up
    (byte fallback's byte tokens left out of random draws: what a soup of random bytes
    decodes to depends on the whole run of them, and no text is made of it)."""
    out = []
    for text in TEXTS:
        ids = tokenizer.encode(text * 2, add_special_tokens=False)
        out += [(ids[:cut], ids[cut:cut + 12]) for cut in range(1, len(ids) - 1)]
    size = len(tokenizer)
    for _ in range(n_random):
        out.append(([rng.randrange(first_id, size) for _ in range(rng.randrange(1, 80))],
                    [rng.randrange(first_id, size) for _ in range(12)]))
    return out


@pytest.mark.parametrize(("which", "first_id"), [("qwen_like", 0), ("llama_like", 256)])
@pytest.mark.parametrize("skip_special", [True, False])
def test_tail_priming_streams_the_same_text(request, restore, which, first_id, skip_special):
    tokenizer = request.getfixturevalue(which)
    all_cases = cases(tokenizer, random.Random(7), 300, first_id)
    whole = [stream(tokenizer, p, o, skip_special) for p, o in all_cases]  # vLLM as is
    dw.install(10**9)
    stepped = [stream(tokenizer, p, o, skip_special) for p, o in all_cases]
    dw.install(WINDOW)
    tail = [stream(tokenizer, p, o, skip_special) for p, o in all_cases]
    ends_whole = [not tokenizer.decode(p, skip_special_tokens=skip_special).endswith("\ufffd")
                  for p, _ in all_cases]
    assert sum(len(p) > WINDOW + 3 for p, _ in all_cases) > 500  # the window cut most
    assert sum(bool("".join(w)) for w in whole) > 500  # and there was text to compare
    assert 100 < ends_whole.count(False) < ends_whole.count(True)
    for (prompt, outputs), w, st, t, whole_char in zip(
            all_cases, whole, stepped, tail, ends_whole, strict=True):
        assert t == st, (prompt[-WINDOW - 4:], outputs)
        if whole_char:
            assert t == w, (prompt[-WINDOW - 4:], outputs)


def test_vllm_echoes_the_prompt_where_it_ends_inside_a_character(qwen_like, restore):
    ids = qwen_like.encode("naïve café", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids))
               if qwen_like.decode(ids[:i]).endswith("\ufffd") and i > 6)
    whole = "".join(stream(qwen_like, ids[:cut], ids[cut:], True))
    dw.install(WINDOW)
    tail = "".join(stream(qwen_like, ids[:cut], ids[cut:], True))
    text = qwen_like.decode(ids)
    assert whole.startswith("naïve caf") and whole == text  # the prompt's text again
    assert tail == text[len(qwen_like.decode(ids[:cut]).rstrip("\ufffd")):]


def test_the_stream_sees_the_window_only(qwen_like, restore, monkeypatch):
    """What each request's DecodeStream is built with and stepped through."""
    seen: list[tuple[int, list[int]]] = []
    real = tokenizers.decoders.DecodeStream

    class Recorder:
        def __init__(self, ids=None, **kw):
            self.stream = real(ids=ids, **kw)
            seen.append((len(ids or ()), []))

        def step(self, tokenizer, tid):
            seen[-1][1].append(tid)
            return self.stream.step(tokenizer, tid)

    monkeypatch.setattr(tokenizers.decoders, "DecodeStream", Recorder)
    prompt = qwen_like.encode(TEXTS[0] * 40, add_special_tokens=False)
    out = prompt[:5]
    assert len(prompt) > 300
    whole = stream(qwen_like, prompt, out, True)
    dw.install(32)
    dw.install(32)  # idempotent: wraps vLLM's own __init__, not its own wrapper
    tail = stream(qwen_like, prompt, out, True)
    stream(qwen_like, prompt[:20], out, True)  # shorter than the window: all of it
    assert seen == [(len(prompt), out), (0, prompt[-32:] + out), (0, prompt[:20] + out)]
    assert tail == whole and dw.installed() == 32


def test_window_from_env():
    assert dw.window_from_env({}) is None
    assert dw.window_from_env({dw.ENV: "0"}) is None  # off
    assert dw.window_from_env({dw.ENV: " 64 "}) == 64
    for bad in ("abc", "7", "-1"):
        with pytest.raises(ValueError, match=dw.ENV):
            dw.window_from_env({dw.ENV: bad})


def test_plugin_installs_it_only_when_asked(restore, monkeypatch):
    from kvferry.connectors.plugin import register

    monkeypatch.delenv(dw.ENV, raising=False)
    original = FastIncrementalDetokenizer.__init__
    register()
    assert dw.installed() is None and FastIncrementalDetokenizer.__init__ is original
    monkeypatch.setenv(dw.ENV, "48")
    register()
    assert dw.installed() == 48 and FastIncrementalDetokenizer.__init__.__wrapped__ is original


@pytest.mark.parametrize("backend", ["cpu", "cuda", "neuron"])
def test_every_engine_kvferry_launches_asks_for_it(backend, monkeypatch):
    spec = EngineSpec(role="decode", model="/m", port=8000, backend=backend)
    monkeypatch.delenv(dw.ENV, raising=False)
    assert engine_env(spec)[dw.ENV] == str(dw.DEFAULT_WINDOW)
    monkeypatch.setenv(dw.ENV, "0")  # the launcher's own setting wins: off
    assert engine_env(spec)[dw.ENV] == "0"
