"""A tiny deterministic GRPO run for the loop tests and the golden file."""

from __future__ import annotations

from pathlib import Path

from mxrl.app.sources import TaskSource
from mxrl.app.task import ArithmeticTask
from mxrl.arch import builtin_config
from mxrl.models import build_model
from mxrl.rl.config import GRPOConfig
from mxrl.rl.trainer import GRPOTrainer
from mxrl.runs import RunRecord

# Timings, throughput and memory peaks vary from run to run; everything else (sync/version
# included: a resume restores the engine's weights version) is numerics.
NONDETERMINISTIC = ("time/", "throughput/", "memory/")


class ParitySource(TaskSource):
    """The arithmetic prompts with a reward that a random model already earns about half the
    time (parity of the first sampled token id), so advantages and gradients are not zero."""

    def reward(self, tokens, label) -> float:
        return float(tokens[0] % 2)


def tiny_config(**overrides) -> GRPOConfig:
    base = dict(
        recipe="nvfp4-dequantized",
        steps=3,
        prompts_per_step=4,
        samples_per_prompt=4,
        max_new_tokens=6,
        lr=3e-3,
        seed=0,
        engine_tile=16,
    )
    return GRPOConfig(**{**base, **overrides})


def tiny_trainer(
    root: Path,
    run_id: str,
    micro_batch_tokens: int | None = None,
    decided: bool | None = None,
    **overrides,
) -> GRPOTrainer:
    """`micro_batch_tokens`: the budget a memory estimate would hand the trainer; `decided`:
    its rl.hold_bf16_weights decision (auto)."""
    cfg = tiny_config(**overrides)
    model = build_model(builtin_config("tiny-moe"), seed=0)
    record = RunRecord.create(root, run_id, config=cfg)
    source = ParitySource(ArithmeticTask(seed=0))
    return GRPOTrainer(
        cfg, model, source, record, micro_batch_tokens=micro_batch_tokens,
        hold_bf16_weights=decided,
    )  # fmt: skip


def numerics(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC)} for r in rows]
