"""The trainers' AdamW is torch's fused kernel (mxrl/rl/optim.py says why: the for-loop and
foreach implementations take their roots from MKL on x86 CPUs, which rounds by processor)."""

from __future__ import annotations

from tests.rl.loop_helpers import tiny_trainer


def test_the_trainer_steps_with_the_fused_adamw(tmp_path):
    trainer = tiny_trainer(tmp_path, "optim", steps=1)
    assert trainer.opt.defaults["fused"] is True
    assert trainer.opt.defaults["foreach"] in (None, False)
