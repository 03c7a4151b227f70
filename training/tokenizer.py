"""The demo tokenizer: byte-level BPE trained with `tokenizers` on the training split only.

Saved as `tokenizer.json` + `tokenizer_config.json`, which core/tokenizer.Tokenizer loads unchanged.
The BPE ranks take ids [0, vocab - len(SPECIALS)); the special tokens follow them, as in Kimi's
layout: build_pipeline/tiny_tokenizer.SPECIAL_NAMES (bos, eos, Kimi's chat markers, unk, pad) and
`[MASK]`, the DFlash drafter's mask token.  Byte-level: every string round-trips.  Deterministic for a
given corpus (one thread of input order; the trainer breaks count ties by the pair itself).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from build_pipeline.tiny_tokenizer import SPECIAL_NAMES

MASK = "[MASK]"
SPECIALS = tuple(SPECIAL_NAMES) + (MASK,)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out: str | Path) -> Path:
    """Train on `texts` and write tokenizer.json + tokenizer_config.json into `out`; returns `out`.
    The vocabulary is vocab_size in all (fewer BPE ranks only when the corpus runs out of pairs)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )

    n_ranks = vocab_size - len(SPECIALS)
    if n_ranks < 512:
        raise ValueError(f"vocab_size {vocab_size} leaves {n_ranks} BPE ranks; need >= 512")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_ranks, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(list(texts), trainer=trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    base = tok.get_vocab_size() - len(SPECIALS)
    config = {
        "added_tokens_decoder": {str(base + i): {"content": s, "special": True} for i, s in enumerate(SPECIALS)},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "model_max_length": 1048576,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def special_ids(tokenizer_dir: str | Path) -> dict[str, int]:
    """{special token: id} of a tokenizer written by train_tokenizer."""
    cfg = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text())
    return {v["content"]: int(k) for k, v in cfg["added_tokens_decoder"].items()}
