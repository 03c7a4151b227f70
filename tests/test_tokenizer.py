"""Tokenizers: Kimi-layout tiktoken (specials after the ranks) and tokenizer.json."""

from __future__ import annotations

import json

from core.tokenizer import Tokenizer


def test_tiktoken_roundtrip_specials_and_chat(tiny):
    tok = Tokenizer.load(tiny.get("kimi"))
    text = "The quick brown fox, 2026 times! 中文English"
    assert tok.decode(tok.encode(text)) == text
    end = tok.specials["<|im_end|>"]
    assert tok.encode("<|im_end|>", allowed_special=True) == [end]
    assert end not in tok.encode("<|im_end|>")  # plain text by default
    assert tok.eos_id == tok.specials["[EOS]"] and set(tok.stop_ids()) == {tok.eos_id, end}
    ids = tok.chat("Hi")
    assert ids[0] == tok.specials["<|im_user|>"] and ids[-1] == tok.specials["<|im_middle|>"]
    assert tok.decode([tok.vocab_size + 5]) == "\ufffd"


def test_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    hf = HFTokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<|im_end|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tok = Tokenizer.load(tmp_path)
    assert tok.encode("a b a") == [0, 1, 0] and tok.eos_id == 3 and tok.stop_ids() == (3,)
