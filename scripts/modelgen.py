"""Write model directories (config + tokenizer, no weights) for `--load-format dummy`.

No hub access is needed: the tokenizer is a byte-level BPE trained in-process on a fixed
English text, so every run writes byte-identical files. Engines then run with random
weights, which is enough to exercise KV transfer, scheduling and the HTTP path at real
tensor shapes. The BPE vocab is padded with filler tokens up to the config's vocab_size
so every id a random model can emit still decodes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
BPE_TRAIN_SIZE = 1024
"""Target size of the trained BPE (the corpus is small; the rest is filler)."""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '')"
    " + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A large language model reads a prompt and
writes an answer one token at a time. Serving such a model well means doing two kinds of
work: prefill, which turns the whole prompt into a key and value cache, and decode, which
produces the next token again and again from that cache. Prefill is heavy on compute;
decode is heavy on memory bandwidth. When both run on the same machine they slow each
other down, so many teams now run them on separate machines and move the cache between
them over a fast network.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
Tell me a short story about a ferry that carries boxes across a wide river. The ferry
leaves the north bank at dawn, waits for the boxes to be loaded, and crosses the water
while the sun rises. On the south bank a crew unpacks the boxes and sends the empty ferry
back. Every crossing takes a few minutes, and the crew counts each box twice.
Can you explain what a cache is? A cache keeps recent results close at hand so that the
same work does not have to be done twice. If the answer is already in the cache, it is a
hit; otherwise it is a miss and the work must be done again.
Please summarise the conversation so far in one sentence. Thanks, that was helpful.
What is the capital of France? Paris is the capital of France. What about Germany?
Berlin is the capital of Germany. Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512.
The weather is sunny with a light wind from the west, and rain is expected tomorrow.
Users ask questions, assistants answer them, and systems set the rules of the chat.
In the morning the market opens early. Farmers bring apples, pears, bread, cheese and
honey, and children run between the stalls while their parents talk about prices. By noon
the square is full of music, and by evening only the pigeons remain to collect the crumbs.
Writing good software takes patience: read the error, form a guess, test it, and keep
the change small. Good tests describe behaviour, not implementation, and they fail loudly
when something breaks. Logs should say why, not only what, so that the next engineer can
follow the reasoning at three in the morning without calling anyone.
Mountains rise above the valley, rivers carve deep canyons, and forests cover the hills
in green and gold. Travellers walk the old road, sleep in small villages, and share
stories about storms, bridges, wolves, kings, ships, stars and distant islands.
A recipe for soup: chop onions, carrots and celery; warm olive oil in a heavy pot; cook
the vegetables slowly, add tomatoes, lentils, garlic, salt and pepper, then simmer for
forty minutes. Serve it hot with fresh bread, lemon and a handful of chopped parsley.
Questions worth asking: why did it happen, when did it start, who noticed first, which
parts changed, where is the evidence, and what would convince us that we were wrong?
"""


@dataclass(frozen=True)
class Shape:
    """Qwen3 dimensions; the big ones copy the published Qwen3 config.json values."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool


SHAPES: dict[str, Shape] = {
    "tiny": Shape(256, 4, 4, 2, 64, 512, BPE_TRAIN_SIZE, 32768, True),
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 128, 3072, 151936, 40960, True),
    "qwen3-8b": Shape(4096, 36, 32, 8, 128, 12288, 151936, 40960, False),
    "qwen3-32b": Shape(5120, 64, 64, 8, 128, 25600, 151936, 40960, False),
}


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE on CORPUS, padded with filler tokens to exactly `vocab_size`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, BPE_TRAIN_SIZE),
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} smaller than the base tokenizer ({len(vocab)})")
    for i in range(len(vocab), vocab_size):
        vocab[f"<|filler_{i}|>"] = i
    return Tokenizer.from_str(json.dumps(spec))


def qwen3_config(shape: Shape, special_ids: dict[str, int]) -> dict[str, Any]:
    """A Qwen3ForCausalLM config.json in the published layout."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": special_ids[ENDOFTEXT],
        "eos_token_id": special_ids[IM_END],
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "max_window_layers": shape.num_hidden_layers,
        "model_type": "qwen3",
        "num_attention_heads": shape.num_attention_heads,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_key_value_heads": shape.num_key_value_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": shape.vocab_size,
    }


def tokenizer_config(shape: Shape, special_ids: dict[str, int]) -> dict[str, Any]:
    """tokenizer_config.json: fast tokenizer, Qwen-style chat template, eos/pad."""
    added = {
        str(special_ids[t]): {"content": t, "lstrip": False, "normalized": False,
                              "rstrip": False, "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": shape.max_position_embeddings,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def write_weights(out: Path, shape: Shape, seed: int = 0) -> Path:
    """Deterministic random weights (safetensors) for small shapes.

    vLLM's dummy loader draws every weight from U(-1e-3, 1e-3): logits come out almost
    uniform (all top-k logprobs ~ -ln(vocab)), so a wrong KV block barely moves them.
    Weights scaled like a trained model give peaked, input-sensitive logits, which is what
    a test that must catch a wrong or partial KV block needs.
    """
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, hd, i = shape.hidden_size, shape.head_dim, shape.intermediate_size

    def lin(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) / cols**0.5).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)

    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": (0.3 * torch.randn(shape.vocab_size, h, generator=g)).to(torch.bfloat16),
        "model.norm.weight": ones(h),
    }
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}."
        t.update({
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": lin(shape.num_attention_heads * hd, h),
            p + "self_attn.k_proj.weight": lin(shape.num_key_value_heads * hd, h),
            p + "self_attn.v_proj.weight": lin(shape.num_key_value_heads * hd, h),
            p + "self_attn.o_proj.weight": lin(h, shape.num_attention_heads * hd),
            p + "self_attn.q_norm.weight": ones(hd),
            p + "self_attn.k_norm.weight": ones(hd),
            p + "mlp.gate_proj.weight": lin(i, h),
            p + "mlp.up_proj.weight": lin(i, h),
            p + "mlp.down_proj.weight": lin(h, i),
        })
    if not shape.tie_word_embeddings:
        t["lm_head.weight"] = lin(shape.vocab_size, h)
    path = out / "model.safetensors"
    save_file(t, str(path), metadata={"format": "pt"})
    return path


def write_model(out_dir: str | Path, shape_name: str = "tiny", weights: bool = False) -> Path:
    """Write config, generation config and tokenizer files for `shape_name` into out_dir.

    With ``weights`` (small shapes only) also a deterministic safetensors checkpoint.
    """
    if shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}; choose from {', '.join(SHAPES)}")
    shape = SHAPES[shape_name]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(shape.vocab_size)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    files: dict[str, Any] = {
        "config.json": qwen3_config(shape, ids),
        "generation_config.json": {
            "bos_token_id": ids[ENDOFTEXT],
            "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
            "pad_token_id": ids[ENDOFTEXT],
            "transformers_version": "4.51.0",
        },
        "tokenizer_config.json": tokenizer_config(shape, ids),
        "special_tokens_map.json": {
            "additional_special_tokens": [IM_START, IM_END],
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
        },
    }
    for name, obj in files.items():
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    if weights:
        if shape.hidden_size > 1024:
            raise ValueError("weights are generated for small shapes only; use --load-format dummy")
        write_weights(out, shape)
    return out
