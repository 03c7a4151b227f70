"""A small Kimi-layout tokenizer for tiny models: byte-level BPE ranks in `tiktoken.model` plus 256
special tokens after them, named in `tokenizer_config.json` like Kimi's."""

from __future__ import annotations

import base64
import collections
import json
import re
from pathlib import Path

CORPUS = """
Speculative decoding lets a small drafter propose several tokens that the large target model then
checks in a single forward pass. The target keeps every token it agrees with and adds one of its
own, so the output is exactly what the target alone would have written, only faster. A tree of
guesses covers more of the likely continuations than a single chain: when the first guess at a
position is wrong, a sibling branch may still be right. The tree is built best first from the
drafter's probabilities, and each node may only see the cache and its own ancestors.
The model reads its weights in four bit integers for the experts and in brain float for the rest.
Attention keeps a compressed latent cache of five hundred and twelve values and sixty four rotary
values for every token and every layer, which makes long contexts cheap to hold in memory.
Hello world. The quick brown fox jumps over the lazy dog. Numbers like 1, 2, 3, 42 and 2026 appear
too, as do questions? Answers! Lists: one; two; three. Code like def f(x): return x * 2 fits here.
Every round the engine drafts a block, builds the tree, verifies it, accepts the longest path that
matches, and commits the accepted rows of the cache. Graph capture removes the launch overheads of
small kernels; the mixture of experts reads only the experts a token was routed to, so the cost of a
round grows with the number of distinct experts the tree touches. Morning light crept over quiet
hills while farmers walked to their fields, children laughed near the river, and a distant train
whistled twice before vanishing behind the old stone bridge. Mathematics, physics, chemistry,
biology, history, geography, literature, music and painting: each opens a different window.
"""

SPECIAL_NAMES = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                 "<|im_middle|>", "[UNK]", "[PAD]"]


def train_bpe(text: str, n_ranks: int) -> list[bytes]:
    """Greedy byte-pair merges over whitespace-split words until n_ranks tokens (or no pair is left)."""
    tokens = [bytes([i]) for i in range(256)]
    words = collections.Counter(re.findall(r" ?\w+| ?[^\w\s]+|\s+", text))
    seqs = {w: [bytes([c]) for c in w.encode()] for w in words}
    while len(tokens) < n_ranks:
        pairs: collections.Counter = collections.Counter()
        for w, seq in seqs.items():
            for a, b in zip(seq, seq[1:]):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        (a, b), count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        tokens.append(a + b)
        for w, seq in seqs.items():
            merged, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(seq[i])
                    i += 1
            seqs[w] = merged
    return tokens


def write_tiny_tokenizer(out: Path, vocab_size: int) -> dict[str, int]:
    """Write tiktoken.model + tokenizer_config.json into `out`; returns {special: id}.

    Ranks fill vocab_size - 256 ids (fewer if the corpus runs out of repeated pairs); the 256 special
    ids follow the ranks, as in Kimi's layout.
    """
    n_ranks = vocab_size - 256
    if n_ranks < 256:
        raise ValueError(f"tiny tokenizer needs vocab_size >= 512, got {vocab_size}")
    tokens = train_bpe(CORPUS, n_ranks)
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    (out / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(tokens)
    specials = {name: base + i for i, name in enumerate(SPECIAL_NAMES)}
    config = {
        "added_tokens_decoder": {str(i): {"content": name, "special": True} for name, i in specials.items()},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return specials
