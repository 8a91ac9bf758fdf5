"""Model directories: valid configs, loadable tokenizer, chat template, determinism."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvferry.scripts.modelgen import IM_END, SHAPES, write_model

FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json")


def _digests(d: Path) -> dict[str, str]:
    return {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in FILES}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("m") / "tiny", "tiny")


def test_tiny_files_and_config(tiny: Path) -> None:
    for f in FILES:
        assert (tiny / f).is_file()
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["head_dim"] >= 32
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "bfloat16"
    assert cfg["max_position_embeddings"] == 32768
    tok = json.loads((tiny / "tokenizer.json").read_text())
    assert cfg["vocab_size"] == len(tok["model"]["vocab"])
    assert not any(k.startswith("<|filler") for k in tok["model"]["vocab"])


def test_transformers_loads_tokenizer_and_chat_template(tiny: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny))
    assert tok.eos_token == IM_END and tok.pad_token == "<|endoftext|>"
    text = "Hello, how are you today? Ünïcödé 😀 tabs\tand\nnewlines"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                      "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    chat_ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys"):
        chat_ids = chat_ids["input_ids"]
    assert chat_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert max(chat_ids) < json.loads((tiny / "config.json").read_text())["vocab_size"]


def test_deterministic_across_processes(tiny: Path, tmp_path: Path) -> None:
    code = "import sys; from kvferry.scripts.modelgen import write_model; write_model(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "again")], check=True)
    assert _digests(tmp_path / "again") == _digests(tiny)


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-8b", "qwen3-32b"])
def test_real_shapes(name: str, tmp_path: Path) -> None:
    out = write_model(tmp_path / name, name)
    cfg = json.loads((out / "config.json").read_text())
    shape = SHAPES[name]
    assert cfg["vocab_size"] == 151936
    assert cfg["hidden_size"] == shape.hidden_size and cfg["head_dim"] == 128
    assert cfg["num_key_value_heads"] == 8
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg["vocab_size"]  # every id decodes
    assert tok.decode([151935]) == "<|filler_151935|>"


def test_unknown_shape(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown shape"):
        write_model(tmp_path, "gpt-5")
