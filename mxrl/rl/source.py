"""What the trainer reads: a `PromptSource` gives batches of prompts with their labels and
rewards a completion; `mxrl.app.sources` has the embedded task's and a dataset's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class PromptBatch:
    prompts: list[list[int]]
    labels: list[Any]


class PromptSource(Protocol):
    stop_token_ids: tuple[int, ...]

    def next_batch(self, n: int) -> PromptBatch: ...
    def reward(self, tokens: list[int], label: Any) -> float: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
