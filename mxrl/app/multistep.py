"""The GPU ablation's task (`mxrl ablate`): multi-step integer arithmetic that the built-in
CharTokenizer can encode, harder than the demo's one-line sums so that RL has room to move.

A problem is `a<op1>b<op2>c=` with 0 <= a, b, c <= max_operand and op1, op2 in `ops` (a subset of
"+-*"); the answer is the integer the expression evaluates to under the usual precedence
(multiplication first, then left to right): `7*8-12=` is 44, `3+4*5=` is 23, `2-9-4=` is -11.
With max_operand 12 the answers run from -144 (0-12*12) to 1728 (12*12*12): one to four digits
and a sign, so an answer is several tokens and one step of the policy cannot guess it. The
prompt is that text, BOS first; the completion the answer's characters then EOS; the reward is
1.0 when the response starts with exactly the answer (`rewards.integer_reward`), as in the
demo's task.

Splits, by a hash of (split_seed, problem) as `ArithmeticTask`'s: a problem whose hash falls
below `eval_fraction` is held out (the eval set, never trained on by the warm-up or by RL); one
in [eval_fraction, 2 x eval_fraction) is the dev split, never trained on either, which the
warm-up reads to decide when to stop (so that choice never looks at the eval set); the rest is
the train split. Draws are counter based, so the task is deterministic given its seed and
resumes from `state_dict()`.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

from mxrl.app.task import ArithmeticTask

OPS = "+-*"


def evaluate(operands: tuple[int, ...], ops: tuple[str, ...]) -> int:
    """The integer value of operands[0] ops[0] operands[1] ... with multiplication first, then
    + and - from left to right (Python's precedence, without eval)."""
    if len(operands) != len(ops) + 1:
        raise ValueError(f"{len(operands)} operands need {len(operands) - 1} operators")
    terms, signs = [operands[0]], [1]  # a sum of signed products
    for op, x in zip(ops, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= x
        elif op in "+-":
            terms.append(x)
            signs.append(1 if op == "+" else -1)
        else:
            raise ValueError(f"unknown operator {op!r}; use one of {OPS!r}")
    return sum(s * t for s, t in zip(signs, terms, strict=True))


@dataclass(frozen=True)
class Expression:
    """One problem: operands and the operators between them."""

    operands: tuple[int, ...]
    ops: tuple[str, ...]

    @property
    def prompt(self) -> str:
        text = str(self.operands[0])
        for op, x in zip(self.ops, self.operands[1:], strict=True):
            text += f"{op}{x}"
        return text + "="

    @property
    def answer(self) -> int:
        return evaluate(self.operands, self.ops)

    @property
    def label(self) -> str:
        return str(self.answer)


class MultiStepTask(ArithmeticTask):
    """Multi-step arithmetic (module docstring has the rules); the streams, tokens, reward, SFT
    examples and resume of `ArithmeticTask`, with three operands and a dev split. `dev_problems()`:
    `eval_size` distinct dev-split problems (the warm-up's stopping set)."""

    _STATE_SETTINGS = ("seed", "split_seed", "max_operand", "ops", "eval_fraction", "num_operands")

    def __init__(
        self,
        seed: int = 0,
        max_operand: int = 12,
        ops: str = OPS,
        *,
        num_operands: int = 3,
        eval_fraction: float = 0.1,
        eval_size: int = 200,
        tokenizer: Any | None = None,
        split_seed: int | None = None,
    ) -> None:
        if num_operands < 2:
            raise ValueError(f"num_operands must be >= 2, got {num_operands}")
        if not 0.0 < eval_fraction < 0.5:
            raise ValueError(
                f"eval_fraction must be in (0, 0.5) (the dev split takes as many), got "
                f"{eval_fraction}"
            )
        self.num_operands = num_operands
        # ArithmeticTask's checks of max_operand, ops and tokenizer; eval_size against this space
        super().__init__(
            seed, max_operand, ops, eval_fraction=eval_fraction, eval_size=1,
            tokenizer=tokenizer, split_seed=split_seed,
        )  # fmt: skip
        space = (max_operand + 1) ** num_operands * len(ops) ** (num_operands - 1)
        if not 1 <= eval_size <= space * eval_fraction / 2:
            raise ValueError(
                f"eval_size {eval_size} is not in [1, {int(space * eval_fraction / 2)}] (half the "
                f"~{int(space * eval_fraction)} eval problems of max_operand={max_operand}, "
                f"ops={ops!r}, num_operands={num_operands}); raise max_operand or lower eval_size"
            )
        self.eval_size = eval_size
        self._dev: list[Expression] | None = None

    def _bucket(self, problem: Expression) -> float:
        key = f"{self.split_seed}:multistep:{problem.prompt}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") / 2**64

    def is_eval(self, problem: Expression) -> bool:  # type: ignore[override]
        """Held out from training: the eval split and the dev split alike."""
        return self._bucket(problem) < 2 * self.eval_fraction

    def is_test(self, problem: Expression) -> bool:
        return self._bucket(problem) < self.eval_fraction

    def _draw(self, stream: str, i: int) -> Expression:  # type: ignore[override]
        seed = self.split_seed if stream in ("eval", "dev") else self.seed
        rng = random.Random(f"mxrl-multistep:{seed}:{stream}:{i}")
        operands = tuple(rng.randint(0, self.max_operand) for _ in range(self.num_operands))
        return Expression(operands, tuple(rng.choice(self.ops) for _ in operands[1:]))

    def _distinct(self, stream: str, keep) -> list[Expression]:
        seen: dict[Expression, None] = {}
        i = 0
        while len(seen) < self.eval_size:
            if i > 1000 * self.eval_size:
                raise ValueError(
                    f"found only {len(seen)} {stream} problems for eval_size={self.eval_size}"
                )
            p = self._draw(stream, i)
            i += 1
            if keep(p):
                seen.setdefault(p)
        return list(seen)

    def eval_problems(self) -> list[Expression]:  # type: ignore[override]
        """The fixed eval set: `eval_size` distinct problems of the eval split."""
        if self._eval is None:
            self._eval = self._distinct("eval", self.is_test)  # type: ignore[assignment]
        return list(self._eval)  # type: ignore[arg-type]

    def dev_problems(self) -> list[Expression]:
        """`eval_size` distinct problems of the dev split (held out, but not the eval set)."""
        if self._dev is None:
            self._dev = self._distinct("dev", lambda p: self.is_eval(p) and not self.is_test(p))
        return list(self._dev)

    @property
    def max_new_tokens(self) -> int:
        """Enough for the longest answer (sign included) plus EOS."""
        m, k = self.max_operand, self.num_operands
        extremes = [m * k if "+" in self.ops else m]
        if "*" in self.ops:
            extremes.append(m**k)
        if "-" in self.ops:
            # 0 minus the rest: -m**(k-1) with products, -(k-1)*m without
            extremes.append(-(m ** (k - 1)) if "*" in self.ops else -m * (k - 1))
        return max(len(str(v)) for v in extremes) + 1

    def fresh(self) -> MultiStepTask:
        return MultiStepTask(
            self.seed, self.max_operand, self.ops, num_operands=self.num_operands,
            eval_fraction=self.eval_fraction, eval_size=self.eval_size,
            tokenizer=self.tokenizer, split_seed=self.split_seed,
        )  # fmt: skip
