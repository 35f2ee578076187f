"""Tokenizers: a checkpoint's own (`load_tokenizer`) and a built-in character tokenizer for the
tiny model and the embedded arithmetic task (`CharTokenizer`, vocab <= 64 = tiny-moe's)."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
# Specials first, so <pad> = 0, <bos> = 1, <eos> = 2 whatever the character set becomes.
_CHARS = "0123456789+-*/=?.,:() \nabcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """One token per character: digits, `+ - * / = ? . , : ( )`, space, newline, a-z.

    Lower-case only; any other character raises ValueError (silently mapping it to an unknown
    token would hide a prompt the model can never see correctly).
    """

    def __init__(self) -> None:
        self.vocab: list[str] = [PAD, BOS, EOS, *_CHARS]
        self._ids = {tok: i for i, tok in enumerate(self.vocab)}
        assert len(self.vocab) == len(self._ids) <= 64

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self.bos_token_id] if add_bos else []
        for i, ch in enumerate(text):
            tok = self._ids.get(ch)
            if tok is None or tok < 3:
                raise ValueError(
                    f"CharTokenizer cannot encode {ch!r} at position {i} of {text[:40]!r}; it "
                    f"knows {_CHARS!r} (lower-case the text or drop the character)"
                )
            ids.append(tok)
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.vocab):
                raise ValueError(
                    f"token id {i} is outside CharTokenizer's vocab (0..{len(self.vocab) - 1})"
                )
            if i < 3 and skip_special_tokens:
                continue
            out.append(self.vocab[i])
        return "".join(out)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


def load_tokenizer(path: str | Path) -> Any | None:
    """The tokenizer of a checkpoint directory, or None when it holds no `tokenizer.json`.

    Returns a `transformers` fast tokenizer (chat template and special tokens from
    tokenizer_config.json) when transformers is installed, else a bare `tokenizers.Tokenizer`.
    """
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        return None
    if importlib.util.find_spec("transformers") is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    if importlib.util.find_spec("tokenizers") is not None:
        from tokenizers import Tokenizer

        logger.info("transformers is not installed; returning a bare tokenizers.Tokenizer")
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    raise ValueError(
        f"{path} has a tokenizer.json, but neither transformers nor tokenizers is installed; "
        "pip install tokenizers (or transformers)"
    )
