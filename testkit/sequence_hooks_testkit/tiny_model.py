# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A tiny Llama model and tokenizer, made locally with no network.

The model is a random-weight ``LlamaForCausalLM`` (fp32, head_dim 32: the
CPU paged attention refuses smaller heads) whose weights are scaled up so
that greedy choices have wide logit margins and do not flip with batch
composition. The tokenizer is a word-level fast tokenizer whose vocabulary
holds the sequence-hook tokens as special tokens.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
# The sequence-hook tokens: spawn a child, join the children, and the role
# marker forced as a child's first token.
SYNC, PROMISE, CHILD = "<sync>", "<promise>", "<child>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD, SYNC, PROMISE, CHILD]
WORDS = [
    "the", "a", "an", "one", "two", "three", "four", "five", "six", "seven",
    "eight", "nine", "ten", "cat", "dog", "bird", "fish", "tree", "sun",
    "moon", "star", "red", "blue", "green", "big", "small", "old", "new",
    "runs", "sees", "eats", "finds", "likes", "has", "makes", "and", "or",
    "but", "then", "so", "if", "it", "is", "was", "on", "in", "at", "to", "of",
    "with", "from", "by", "for", "up", "down", "left", "right", "yes", "no"
]

# Long enough for the tests, short enough for rotary tables to stay in
# bounds: never serve it with a larger max_model_len.
MAX_POSITIONS = 512
# Chat prompts: the messages' contents, one after the other.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }} "
                 "{% endfor %}")


@dataclass(frozen=True)
class HookIds:
    """Token ids of the tiny tokenizer that the hook tests use."""
    # `<sync>`: join the children.
    sync: int
    # `<promise>`: spawn a child.
    promise: int
    # `<child>`: the role marker.
    child: int
    # End of sequence.
    eos: int


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and seed of a tiny test model."""
    # Seed for the weights; the same seed gives the same files.
    seed: int = 0
    # Model width; head_dim = hidden_size // num_heads must be >= 32.
    hidden_size: int = 128
    # Attention heads (and key/value heads).
    num_heads: int = 4
    # Decoder layers.
    num_layers: int = 2
    # Multiplier on the random weights: larger means wider logit margins.
    weight_scale: float = 4.0
    # Rotary table length: never serve with a larger max_model_len.
    max_positions: int = MAX_POSITIONS


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Returns the word-level fast tokenizer with the hook tokens and a
    chat template."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        additional_special_tokens=[SYNC, PROMISE, CHILD])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_hook_ids() -> HookIds:
    """The hook token ids of the tiny tokenizer."""
    tokenizer = build_tokenizer()
    return HookIds(*tokenizer.convert_tokens_to_ids([SYNC, PROMISE, CHILD]),
                   tokenizer.eos_token_id)


def build_tiny_model(
        path: Path,
        spec: Optional[TinyModelSpec] = None,
        tokenizer: Optional[PreTrainedTokenizerFast] = None) -> Path:
    """Writes a tiny Llama checkpoint and its tokenizer to ``path``.

    Args:
        path: Folder to write into; created if missing.
        spec: Shape and seed of the model; the default spec if None.
        tokenizer: The tokenizer (it sets the vocabulary); this module's
            word-level one if None.

    Returns:
        ``path``, ready for ``LLM(model=str(path))``.
    """
    spec = spec or TinyModelSpec()
    tokenizer = tokenizer or build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer),
                         hidden_size=spec.hidden_size,
                         intermediate_size=2 * spec.hidden_size,
                         num_hidden_layers=spec.num_layers,
                         num_attention_heads=spec.num_heads,
                         num_key_value_heads=spec.num_heads,
                         max_position_embeddings=spec.max_positions,
                         bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False,
                         torch_dtype="float32")
    generator = torch.Generator().manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            weight.copy_(
                torch.randn(weight.shape, generator=generator) *
                spec.weight_scale / weight.shape[-1]**0.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
