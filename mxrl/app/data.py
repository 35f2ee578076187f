"""Prompt datasets for RL: JSONL or Parquet rows holding a prompt and a label (the ground truth
the reward function compares against).

Layouts read (rl_frameworks.md §1 "Dataset format"):
- slime / miles jsonl, e.g. zhuzilin/dapo-math-17k: {"prompt": [{"role": "user", "content": ...}],
  "label": "34"}  -> prompt_key="prompt", label_key="label" (the defaults);
- verl parquet, e.g. BytedTsinghua-SIA/DAPO-Math-17k: columns data_source, prompt (list of
  messages), ability, reward_model {ground_truth, style}, extra_info -> label_key=
  "reward_model.ground_truth" (keys are dotted paths into nested objects);
- plain prompts: {"prompt": "What is 2+2?", "label": "4"}.

A prompt is a string (used verbatim) or a list of chat messages {role, content}; rendering
applies the tokenizer's chat template when it has one (transformers tokenizers), else joins the
message contents with newlines (CharTokenizer and bare tokenizers have no template).

Malformed rows (bad JSON line, missing key, wrong type, empty prompt) are skipped, each one
recorded in `dataset.skipped` with its row and reason and summarised in one warning; a file
with no usable row is an error naming the file. Blank JSONL lines are not rows; a UTF-8 byte order
mark at the start of the file is not part of the first one.
"""

from __future__ import annotations

import codecs
import json
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

Messages = list[dict[str, str]]
Prompt = str | Messages

_JSONL_SUFFIXES = {".jsonl", ".ndjson", ".json"}
_PARQUET_SUFFIXES = {".parquet", ".pq"}


@dataclass(frozen=True)
class PromptExample:
    """One usable row: `index` is its row in the file (0-based; for JSONL the line number - 1),
    `row` the whole record (for reward functions that need more than the label)."""

    index: int
    prompt: Prompt
    label: Any
    row: dict[str, Any]


@dataclass(frozen=True)
class SkippedRow:
    row: int
    reason: str


class _BadRow(Exception):
    pass


class PromptDataset:
    """Examples plus a deterministic, resumable sampling order.

    next_batch(n) walks a permutation of the examples that is reshuffled each epoch from
    (seed, epoch); a batch that crosses the end of an epoch continues into the next one, so no
    example is dropped and every batch is full. state_dict() records (epoch, position).
    """

    def __init__(
        self,
        examples: Sequence[PromptExample],
        *,
        source: str = "<rows>",
        skipped: Sequence[SkippedRow] = (),
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if not examples:
            raise ValueError(f"{source}: no usable rows; {_first_reasons(skipped)}")
        self.examples = list(examples)
        self.source = source
        self.skipped = list(skipped)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    # --- loading --------------------------------------------------------------------------

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        prompt_key: str = "prompt",
        label_key: str | None = "label",
        *,
        seed: int = 0,
        shuffle: bool = True,
        limit: int | None = None,
    ) -> PromptDataset:
        """Load a .jsonl / .ndjson / .json (JSON lines, or one JSON array) or .parquet / .pq
        file. `prompt_key` and `label_key` are dotted paths ("reward_model.ground_truth");
        label_key=None loads prompts without labels. `limit` stops after that many rows."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"dataset file {path} does not exist")
        suffix = path.suffix.lower()
        if suffix in _PARQUET_SUFFIXES:
            records = _parquet_rows(path)
        elif suffix in _JSONL_SUFFIXES:
            records = _json_rows(path)
        else:
            raise ValueError(
                f"{path}: unknown dataset format {suffix!r}; use .jsonl, .json or .parquet"
            )
        return cls._from_indexed(records, prompt_key, label_key, str(path), seed, shuffle, limit)

    @classmethod
    def from_rows(
        cls,
        rows: Iterable[Any],
        prompt_key: str = "prompt",
        label_key: str | None = "label",
        *,
        source: str = "<rows>",
        seed: int = 0,
        shuffle: bool = True,
        limit: int | None = None,
    ) -> PromptDataset:
        """In-memory records (dicts), validated like a file's rows (row i = position i)."""
        return cls._from_indexed(
            enumerate(rows), prompt_key, label_key, source, seed, shuffle, limit
        )

    @classmethod
    def _from_indexed(
        cls,
        rows: Iterable[tuple[int, Any]],
        prompt_key: str,
        label_key: str | None,
        source: str,
        seed: int,
        shuffle: bool,
        limit: int | None,
    ) -> PromptDataset:
        examples: list[PromptExample] = []
        skipped: list[SkippedRow] = []
        for n, (index, record) in enumerate(rows):
            if limit is not None and n >= limit:
                break
            try:
                if isinstance(record, _BadRow):
                    raise record
                examples.append(_example(index, record, prompt_key, label_key))
            except _BadRow as err:
                skipped.append(SkippedRow(index, str(err)))
        if skipped:
            kinds = Counter(s.reason.split(":")[0] for s in skipped)
            logger.warning(
                "%s: skipped %d of %d rows (%s); %s",
                source,
                len(skipped),
                len(skipped) + len(examples),
                ", ".join(f"{k}: {v}" for k, v in kinds.most_common()),
                _first_reasons(skipped),
            )
        logger.info("%s: %d prompts", source, len(examples))
        return cls(examples, source=source, skipped=skipped, seed=seed, shuffle=shuffle)

    # --- access ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> PromptExample:
        return self.examples[i]

    def __iter__(self) -> Iterator[PromptExample]:
        return iter(self.examples)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(f"mxrl-data:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[PromptExample]:
        """The next n examples of the shuffled stream (crossing epochs when needed)."""
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        out = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(n - len(out), len(self._order) - self.position)
            out += [self.examples[i] for i in self._order[self.position : self.position + take]]
            self.position += take
        return out

    def keeping(self, reason: Callable[[PromptExample], str | None]) -> PromptDataset:
        """A dataset of the examples for which `reason(example)` is None; the others are added
        to `skipped` with their reason (e.g. a prompt too long for the model). The sampling order
        is drawn over what is kept, so the stream is a function of the file and the filter."""
        kept, skipped = [], list(self.skipped)
        for example in self.examples:
            why = reason(example)
            if why is None:
                kept.append(example)
            else:
                skipped.append(SkippedRow(example.index, why))
        if len(skipped) > len(self.skipped):
            logger.warning(
                "%s: skipped %d more rows (%s)", self.source, len(skipped) - len(self.skipped),
                _first_reasons(skipped[len(self.skipped) :]),
            )  # fmt: skip
        return PromptDataset(kept, source=self.source, skipped=skipped, seed=self.seed,
                             shuffle=self.shuffle)  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
            "num_examples": len(self.examples),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_examples"] != len(self.examples):
            raise ValueError(
                f"{self.source}: the checkpoint saw {state['num_examples']} prompts, this file "
                f"has {len(self.examples)}; resume with the same data file and keys"
            )
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)


# --- rendering ------------------------------------------------------------------------------


def decode_tokens(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """Text of generated ids. Ids the tokenizer cannot decode (a model's vocab may be larger
    than its tokenizer's: tiny-moe has 64, CharTokenizer 52) become U+FFFD, which no reward
    accepts as part of an answer."""
    ids = [int(t) for t in token_ids]
    try:
        return tokenizer.decode(ids)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError):
        pass  # some id is out of the tokenizer's vocab: decode one token at a time
    out = []
    for t in ids:
        try:
            out.append(tokenizer.decode([t]))
        except (ValueError, IndexError, KeyError, TypeError, OverflowError):
            out.append("\ufffd")
    return "".join(out)


def has_chat_template(tokenizer: Any) -> bool:
    return callable(getattr(tokenizer, "apply_chat_template", None)) and bool(
        getattr(tokenizer, "chat_template", None)
    )


def render_prompt(
    prompt: Prompt,
    tokenizer: Any | None = None,
    *,
    chat_template: bool = True,
    wrap_strings: bool = False,
) -> str:
    """The prompt's text. Messages go through the tokenizer's chat template (with the
    generation prompt) when chat_template and the tokenizer has one; otherwise their contents
    are joined with newlines. A string is used verbatim, unless wrap_strings: then it becomes
    one user message first (slime's --apply-chat-template on string prompts)."""
    if isinstance(prompt, str):
        if not (wrap_strings and chat_template and has_chat_template(tokenizer)):
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    if chat_template and has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in prompt)


def encode_prompt(
    prompt: Prompt, tokenizer: Any, *, chat_template: bool = True, wrap_strings: bool = False
) -> list[int]:
    """Token ids of render_prompt(...). Text from a chat template is encoded without adding
    special tokens again (the template holds them, as verl and TRL do)."""
    text = render_prompt(prompt, tokenizer, chat_template=chat_template, wrap_strings=wrap_strings)
    is_chat = not isinstance(prompt, str) or wrap_strings
    if chat_template and is_chat and has_chat_template(tokenizer):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids = tokenizer.encode(text)
    return list(getattr(ids, "ids", ids))  # a bare tokenizers.Tokenizer returns an Encoding


# --- readers and validation ------------------------------------------------------------------


def _json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    data = path.read_bytes()
    # A UTF-8 byte order mark (Windows editors, Excel exports) is not part of the first row: left
    # in, it made line 1 bad JSON (and hid a JSON array from the check below).
    data = data.removeprefix(codecs.BOM_UTF8)
    if path.suffix.lower() == ".json" and data.lstrip()[:1] == b"[":
        try:
            rows = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from err
        yield from enumerate(rows)
        return
    for i, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        try:
            yield i, json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as err:
            yield i, _BadRow(f"bad encoding: line {i + 1} is not UTF-8 ({err.reason})")
        except json.JSONDecodeError as err:
            yield i, _BadRow(f"bad JSON: line {i + 1}: {err.msg} at column {err.colno}")


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path}: not a readable Parquet file ({err})") from err
    i = 0
    for batch in reader.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            yield i, row
            i += 1


def _get_path(record: dict[str, Any], path: str) -> Any:
    if path in record:
        return record[path]
    node: Any = record
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise _BadRow(f"missing key: {path!r}")
        node = node[part]
    return node


def _example(index: int, record: Any, prompt_key: str, label_key: str | None) -> PromptExample:
    if not isinstance(record, dict):
        raise _BadRow(f"wrong type: row is {type(record).__name__}, expected a JSON object")
    prompt = _check_prompt(_get_path(record, prompt_key), prompt_key)
    label = None
    if label_key is not None:
        label = _get_path(record, label_key)
        if label is None or (isinstance(label, str) and not label.strip()):
            raise _BadRow(f"empty label: {label_key!r} is {label!r}")
    return PromptExample(index, prompt, label, record)


def _check_prompt(prompt: Any, key: str) -> Prompt:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _BadRow(f"empty prompt: {key!r} is blank")
        return prompt
    if not isinstance(prompt, list):
        raise _BadRow(
            f"wrong type: {key!r} is {type(prompt).__name__}, expected a string or a list of "
            "{role, content} messages"
        )
    if not prompt:
        raise _BadRow(f"empty prompt: {key!r} has no messages")
    messages = []
    for j, m in enumerate(prompt):
        if not isinstance(m, dict):
            raise _BadRow(f"wrong type: {key}[{j}] is {type(m).__name__}, expected a message")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise _BadRow(f"wrong type: {key}[{j}] needs string 'role' and 'content'")
        messages.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in messages):
        raise _BadRow(f"empty prompt: every message of {key!r} is blank")
    return messages


def _first_reasons(skipped: Sequence[SkippedRow], k: int = 3) -> str:
    if not skipped:
        return "the file holds no rows"
    shown = "; ".join(f"row {s.row}: {s.reason}" for s in skipped[:k])
    more = f" (+{len(skipped) - k} more in dataset.skipped)" if len(skipped) > k else ""
    return f"first: {shown}{more}"
