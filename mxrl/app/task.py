"""The embedded task: integer arithmetic that the built-in CharTokenizer can encode, for machines
without a model hub (CI, the tiny model, the ablation demo).

A problem is `a<op>b=` with 0 <= a, b <= max_operand and op in `ops` (a subset of "+-*"); the
answer is the integer a op b (negative for some subtractions). The prompt is that text, BOS
first; the expected completion is the answer's digits then EOS. The reward is 1.0 when the
response starts with exactly the answer (`rewards.leading_integer`: sign and digits up to the
first other character or EOS), 0.0 otherwise.

Splits: a problem belongs to eval when a hash of (split_seed, problem) falls below
`eval_fraction`, so train and eval never share a problem, whatever the number of draws, without
enumerating the problem space. `split_seed` defaults to `seed`; tasks that share it (the demo's
warm-up and its RL seeds) share one split and one eval set, so nothing any of them trains on is
ever evaluated. Draws are counter based (draw i of a stream depends only on seed, stream name
and i), so the task is deterministic given the seed and resumes from `state_dict()`.
"""

from __future__ import annotations

import hashlib
import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mxrl.app.data import decode_tokens
from mxrl.app.rewards import integer_reward
from mxrl.models.tokenizer import CharTokenizer

_OPS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> int:
        return _OPS[self.op](self.a, self.b)

    @property
    def label(self) -> str:
        """The answer as text: what `rewards.integer_reward` (load_reward("integer")) expects."""
        return str(self.answer)


@dataclass(frozen=True)
class SupervisedExample:
    """One warm-up SFT sequence: the loss goes on `completion_ids` (answer digits + EOS) given
    `prompt_ids` (BOS + prompt)."""

    problem: Problem
    prompt_ids: list[int]
    completion_ids: list[int]

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt_ids, *self.completion_ids]

    @property
    def loss_mask(self) -> list[int]:
        """1 on the targets that are completion tokens, aligned with tokens[1:] (next-token
        prediction: position t predicts tokens[t + 1])."""
        return [0] * (len(self.prompt_ids) - 1) + [1] * len(self.completion_ids)


class ArithmeticTask:
    """Arithmetic problems with an exact integer reward (module docstring has the rules).

    sample(n): the next n train problems (the "rl" stream); supervised_examples(n): the next n
    SFT sequences (a separate "sft" stream of train problems); eval_problems(): the fixed eval
    set (distinct problems). The tokenizer defaults to CharTokenizer; any tokenizer with
    encode(text) and eos_token_id works (CharTokenizer gets a BOS, others their own specials).
    """

    def __init__(
        self,
        seed: int = 0,
        max_operand: int = 20,
        ops: str = "+-",
        *,
        eval_fraction: float = 0.1,
        eval_size: int = 32,
        tokenizer: Any | None = None,
        split_seed: int | None = None,
    ) -> None:
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        if not ops or any(op not in _OPS for op in ops) or len(set(ops)) != len(ops):
            raise ValueError(f"ops must be distinct characters of '+-*', got {ops!r}")
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        space = (max_operand + 1) ** 2 * len(ops)
        if not 1 <= eval_size <= space * eval_fraction / 2:
            raise ValueError(
                f"eval_size {eval_size} is not in [1, {int(space * eval_fraction / 2)}] (half the "
                f"~{int(space * eval_fraction)} eval problems of max_operand={max_operand}, "
                f"ops={ops!r}); raise max_operand or eval_fraction, or lower eval_size"
            )
        self.seed = int(seed)
        self.split_seed = self.seed if split_seed is None else int(split_seed)
        self.max_operand = max_operand
        self.ops = ops
        self.eval_fraction = eval_fraction
        self.eval_size = eval_size
        self.tokenizer = tokenizer if tokenizer is not None else CharTokenizer()
        self._positions = {"rl": 0, "sft": 0}
        self._eval: list[Problem] | None = None

    # --- problems -------------------------------------------------------------------------

    def is_eval(self, problem: Problem) -> bool:
        key = f"{self.split_seed}:{problem.a}{problem.op}{problem.b}".encode()
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        return h / 2**64 < self.eval_fraction

    def _draw(self, stream: str, i: int) -> Problem:
        seed = self.split_seed if stream == "eval" else self.seed  # one eval set per split
        rng = random.Random(f"mxrl-arith:{seed}:{stream}:{i}")
        a = rng.randint(0, self.max_operand)
        b = rng.randint(0, self.max_operand)
        return Problem(a, rng.choice(self.ops), b)

    def _next_train(self, stream: str) -> Problem:
        while True:
            p = self._draw(stream, self._positions[stream])
            self._positions[stream] += 1
            if not self.is_eval(p):
                return p

    def sample(self, n: int) -> list[Problem]:
        """The next n train problems (i.i.d. over the train split; repeats possible)."""
        return [self._next_train("rl") for _ in range(n)]

    def eval_problems(self) -> list[Problem]:
        """The fixed eval set: `eval_size` distinct eval-split problems, same for a split_seed."""
        if self._eval is None:
            seen: dict[Problem, None] = {}
            i = 0
            while len(seen) < self.eval_size:
                if i > 1000 * self.eval_size:  # the hash split left too few eval problems
                    raise ValueError(
                        f"found only {len(seen)} eval problems for eval_size={self.eval_size}; "
                        "raise max_operand or eval_fraction"
                    )
                p = self._draw("eval", i)
                i += 1
                if self.is_eval(p):
                    seen.setdefault(p)
            self._eval = list(seen)
        return list(self._eval)

    # --- tokens and rewards ---------------------------------------------------------------

    def encode_prompt(self, problem: Problem) -> list[int]:
        if isinstance(self.tokenizer, CharTokenizer):
            return self.tokenizer.encode(problem.prompt, add_bos=True)
        return list(self.tokenizer.encode(problem.prompt))

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (int(self.tokenizer.eos_token_id),)

    @property
    def max_new_tokens(self) -> int:
        """Enough for the longest answer plus EOS."""
        m = self.max_operand
        extremes = [2 * m if "+" in self.ops else 0, -m if "-" in self.ops else 0]
        if "*" in self.ops:
            extremes.append(m * m)
        return max(len(str(v)) for v in extremes) + 1

    def decode_response(self, token_ids: Sequence[int]) -> str:
        """The text of generated tokens, up to the first EOS. Ids the tokenizer cannot decode
        (a model's vocab may be larger than CharTokenizer's 52: tiny-moe has 64) become U+FFFD,
        which ends the answer like any other non-digit."""
        eos = self.stop_token_ids[0]
        ids = [int(t) for t in token_ids]
        if eos in ids:
            ids = ids[: ids.index(eos)]
        return decode_tokens(self.tokenizer, ids)

    def reward(self, response_text: str, problem: Problem) -> float:
        """1.0 when the response starts with exactly problem.answer, else 0.0."""
        return integer_reward(response_text, problem.answer)

    def supervised_examples(self, n: int) -> list[SupervisedExample]:
        """The next n SFT sequences (BOS + prompt, then answer + EOS) from the train split."""
        out = []
        for _ in range(n):
            p = self._next_train("sft")
            completion = [*self.tokenizer.encode(p.label), self.stop_token_ids[0]]
            out.append(SupervisedExample(p, self.encode_prompt(p), completion))
        return out

    # --- resume ---------------------------------------------------------------------------

    def fresh(self) -> ArithmeticTask:
        """The same task (seed, split, sizes, tokenizer) with its streams at the start."""
        return ArithmeticTask(
            self.seed, self.max_operand, self.ops, eval_fraction=self.eval_fraction,
            eval_size=self.eval_size, tokenizer=self.tokenizer, split_seed=self.split_seed,
        )  # fmt: skip

    # the settings a state records and a resume checks against its task's own
    _STATE_SETTINGS = ("seed", "split_seed", "max_operand", "ops", "eval_fraction")

    def state_dict(self) -> dict[str, Any]:
        state = {key: getattr(self, key) for key in self._STATE_SETTINGS}
        return {**state, "positions": dict(self._positions)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a state from before split_seed existed split by its seed
        state = {"split_seed": state.get("seed"), **state}
        for key in self._STATE_SETTINGS:
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"ArithmeticTask state has {key}={state.get(key)!r} but this task has "
                    f"{getattr(self, key)!r}; build the task with the checkpoint's settings"
                )
        self._positions = {k: int(v) for k, v in state["positions"].items()}
