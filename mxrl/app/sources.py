"""Where the RL loop's prompts, labels and rewards come from: the embedded arithmetic task, or a
prompt dataset file with a tokenizer and a reward function (`mxrl.rl.source.PromptSource`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from mxrl.app.data import PromptDataset, decode_tokens, encode_prompt
from mxrl.rl.source import PromptBatch


class Task(Protocol):
    """What a generated task gives the RL loop (`TaskSource`) and the SFT warm-up
    (`mxrl.app.warmup`): the demo's `ArithmeticTask` and the ablation's `MultiStepTask`."""

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...
    @property
    def max_new_tokens(self) -> int: ...
    def sample(self, n: int) -> list[Any]: ...
    def eval_problems(self) -> list[Any]: ...
    def encode_prompt(self, problem: Any) -> list[int]: ...
    def decode_response(self, token_ids: Sequence[int]) -> str: ...
    def reward(self, response_text: str, problem: Any) -> float: ...
    def supervised_examples(self, n: int) -> list[Any]: ...
    def fresh(self) -> Task: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TaskSource:
    """A generated task (no model hub needed): the embedded arithmetic task, or any `Task`."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.stop_token_ids = task.stop_token_ids

    def next_batch(self, n: int) -> PromptBatch:
        problems = self.task.sample(n)
        return PromptBatch([self.task.encode_prompt(p) for p in problems], problems)

    def eval_batch(self) -> PromptBatch:
        """The task's fixed held-out problems (never sampled for training)."""
        problems = self.task.eval_problems()
        return PromptBatch([self.task.encode_prompt(p) for p in problems], problems)

    def reward(self, tokens: list[int], label: Any) -> float:
        return self.task.reward(self.task.decode_response(tokens), label)

    def state_dict(self) -> dict[str, Any]:
        return self.task.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.task.load_state_dict(state)


class DatasetSource:
    """A PromptDataset (JSONL / Parquet), a tokenizer (chat template when it has one) and a
    reward function `fn(response_text, label) -> float`."""

    def __init__(self, dataset: PromptDataset, tokenizer: Any, reward_fn) -> None:
        self.dataset, self.tokenizer, self.reward_fn = dataset, tokenizer, reward_fn
        self.stop_token_ids = (int(tokenizer.eos_token_id),)

    def next_batch(self, n: int) -> PromptBatch:
        rows = self.dataset.next_batch(n)
        return PromptBatch(
            [encode_prompt(r.prompt, self.tokenizer) for r in rows], [r.label for r in rows]
        )

    def reward(self, tokens: list[int], label: Any) -> float:
        ids = list(tokens)
        eos = self.stop_token_ids[0]
        if eos in ids:
            ids = ids[: ids.index(eos)]
        return float(self.reward_fn(decode_tokens(self.tokenizer, ids), label))

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
