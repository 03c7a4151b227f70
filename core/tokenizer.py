"""Tokenizers: Kimi's tiktoken BPE (`tiktoken.model` + `tokenizer_config.json`) or a `tokenizer.json`.

Kimi's `tokenization_kimi.py` is remote code and is never run; its pre-tokenizer pattern and its
special-token layout (256 specials after the BPE ranks, named in `added_tokens_decoder`, the rest
`<|reserved_token_i|>`) are reproduced here.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from core.errors import CheckpointError

# Kimi K2.x pre-tokenizer (`&&` is character-class intersection: Han runs split from letters)
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NUM_SPECIAL = 256
CHAT_MARKERS = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>")


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse `tiktoken.model`: one `base64(token) rank` per line."""
    ranks: dict[bytes, int] = {}
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not a tiktoken BPE file (not UTF-8 text)") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise CheckpointError(f"{path}:{lineno}: expected `base64-token rank`") from None
    return ranks


class Tokenizer:
    """encode/decode plus the special ids the runtime needs (stop tokens, chat markers)."""

    def __init__(self, encode_fn, decode_fn, specials: dict[str, int], vocab_size: int,
                 bos: str | None, eos: str | None, chat_template: str | None = None):
        """bos, eos: the tokens' strings; chat_template: the checkpoint's Jinja chat template (its source,
        never run here: runtime/serve/template.py renders it in a sandbox), None when it ships none."""
        self._encode, self._decode = encode_fn, decode_fn
        self.specials = specials
        self.vocab_size = vocab_size
        self.bos_token, self.eos_token = bos, eos
        self.bos_id = specials.get(bos) if bos else None
        self.eos_id = specials.get(eos) if eos else None
        self.chat_template = chat_template

    @classmethod
    def load(cls, model_dir: str | Path) -> "Tokenizer":
        d = Path(model_dir)
        cfg_path = d / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({exc})") from None
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{cfg_path}: top level must be a JSON object")
        template = _chat_template(d, cfg)
        if (d / "tiktoken.model").is_file():
            return cls._from_tiktoken(d / "tiktoken.model", cfg, template)
        if (d / "tokenizer.json").is_file():
            return cls._from_tokenizers(d / "tokenizer.json", cfg, template)
        raise CheckpointError(f"{d}: no tokenizer (expected tiktoken.model or tokenizer.json)")

    @classmethod
    def _from_tiktoken(cls, path: Path, cfg: dict, template: str | None) -> "Tokenizer":
        import tiktoken

        ranks = read_tiktoken_ranks(path)
        n = len(ranks)
        specials = {_content(v): int(k) for k, v in (cfg.get("added_tokens_decoder") or {}).items()}
        taken = set(specials.values())
        for i in range(n, n + NUM_SPECIAL):
            if i not in taken:
                specials[f"<|reserved_token_{i}|>"] = i
        enc = tiktoken.Encoding(name=path.parent.name or "kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                special_tokens=specials)
        return cls(lambda text, special: enc.encode(text, allowed_special="all" if special else set(),
                                                    disallowed_special=()),
                   lambda ids: enc.decode(ids, errors="replace"), specials, enc.n_vocab,
                   _content(cfg.get("bos_token")), _content(cfg.get("eos_token")), template)

    @classmethod
    def _from_tokenizers(cls, path: Path, cfg: dict, template: str | None) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 (the tokenizers library raises plain Exception)
            raise CheckpointError(f"{path}: not a valid tokenizer.json ({exc})") from None
        specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items()}
        def encode(text: str, special: bool) -> list[int]:
            tok.encode_special_tokens = not special  # False: added tokens in the text are split as text
            return tok.encode(text, add_special_tokens=False).ids

        return cls(encode,
                   lambda ids: tok.decode(ids, skip_special_tokens=False), specials, tok.get_vocab_size(),
                   _content(cfg.get("bos_token")), _content(cfg.get("eos_token")), template)

    def encode(self, text: str, allowed_special: bool = False) -> list[int]:
        """text -> ids.  Special-token strings in the text ("<|im_end|>") are plain text unless
        allowed_special (tiktoken's and vLLM's choice: user text never smuggles control tokens)."""
        return list(self._encode(text, allowed_special))

    def decode(self, ids: list[int]) -> str:
        """Text of ids; ids the tokenizer lacks (vocabulary padding of the model) come out as U+FFFD."""
        ids = list(ids)
        if all(0 <= i < self.vocab_size for i in ids):
            return self._decode(ids)
        parts, run = [], []
        for i in ids:
            if 0 <= i < self.vocab_size:
                run.append(i)
                continue
            parts += [self._decode(run), "\ufffd"]
            run = []
        return "".join(parts) + self._decode(run)

    def stop_ids(self, extra: tuple[int, ...] = ()) -> tuple[int, ...]:
        """eos and <|im_end|> (when the vocabulary has them) plus `extra`."""
        ids = [self.eos_id, self.specials.get("<|im_end|>"), *extra]
        return tuple(sorted({i for i in ids if i is not None}))

    def chat(self, user: str, system: str | None = None, allowed_special: bool = False) -> list[int]:
        """Kimi chat layout: [system turn] user turn, then the assistant header (the markers are control
        tokens; special-token strings inside user / system text only with allowed_special)."""
        missing = [m for m in CHAT_MARKERS if m not in self.specials]
        if missing:
            raise CheckpointError(f"tokenizer lacks chat markers {missing}; drop --chat")
        s = self.specials
        ids = []
        if system is not None:
            ids += [s["<|im_system|>"], *self.encode("system"), s["<|im_middle|>"],
                    *self.encode(system, allowed_special),
                    s["<|im_end|>"]]
        ids += [s["<|im_user|>"], *self.encode("user"), s["<|im_middle|>"], *self.encode(user, allowed_special),
                s["<|im_end|>"]]
        ids += [s["<|im_assistant|>"], *self.encode("assistant"), s["<|im_middle|>"]]
        return ids


class StreamDecoder:
    """Incremental detokenisation: push ids, get the text they complete.  A multi-byte character
    split across tokens is held back until its last byte arrives (no U+FFFD mid-stream)."""

    def __init__(self, tok: Tokenizer, skip: tuple[int, ...] = ()):
        self.tok, self.skip = tok, set(skip)
        self.ids: list[int] = []
        self.emitted = 0  # characters of decode(ids) already returned

    def push(self, token: int) -> str:
        if token in self.skip:
            return ""
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.emitted = text[self.emitted:], len(text)
        return new

    def flush(self) -> str:
        text = self.tok.decode(self.ids)
        new, self.emitted = text[self.emitted:], len(text)
        return new


def _chat_template(d: Path, cfg: dict) -> str | None:
    """The default chat template, where transformers finds it: `chat_template.jinja` beside the config
    (it wins), else tokenizer_config.json's `chat_template` (a string, or a list of named templates:
    the one named "default")."""
    f = d / "chat_template.jinja"
    if f.is_file():
        try:
            return f.read_text()
        except UnicodeDecodeError:
            raise CheckpointError(f"{f}: not UTF-8 text") from None
    t = cfg.get("chat_template")
    if isinstance(t, list):
        t = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}.get("default")
    if t is not None and not isinstance(t, str):
        raise CheckpointError(f"{d / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                              f"{{name, template}}, got {type(t).__name__}")
    return t


def _content(tok) -> str | None:
    """tokenizer_config stores a token either as a string or as {"content": ...}."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok
