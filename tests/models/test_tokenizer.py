"""CharTokenizer and load_tokenizer."""

from __future__ import annotations

import pytest

from mxrl.arch import builtin_config
from mxrl.models import CharTokenizer, load_tokenizer


def test_char_tokenizer_round_trip():
    tok = CharTokenizer()
    text = "what is 12+7*3? answer:\n33 = (a-b)/c."
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == f"<bos>{text}<eos>"
    assert max(ids) < tok.vocab_size <= builtin_config("tiny-moe")["vocab_size"] == 64
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(set(tok.encode("0123456789+-*=? \nabcdefghijklmnopqrstuvwxyz"))) == 43


def test_char_tokenizer_refuses_unknown_characters():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="'A' at position 2"):
        tok.encode("12A")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([999])


def test_load_tokenizer(tmp_path):
    assert load_tokenizer(tmp_path) is None
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "hello": 1, "world": 2}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded is not None
    assert list(loaded.encode("hello world", add_special_tokens=False)) == [1, 2]
