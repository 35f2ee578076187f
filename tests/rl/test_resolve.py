"""The run's choices made once (`mxrl.rl.resolve`): what `resolve_train` decides on the CPU, and a
trainer handed them applies and serves exactly them, resolving nothing again."""

from __future__ import annotations

import pytest
import torch

from mxrl.app.task import ArithmeticTask
from mxrl.arch import builtin_config
from mxrl.kernels import Backend, Gemm
from mxrl.models import build_model
from mxrl.nn import QExperts, QLinear
from mxrl.recipe import resolve
from mxrl.rl import trainer as trainer_mod
from mxrl.rl.resolve import Resolved, resolve_train
from mxrl.rl.trainer import GRPOTrainer
from mxrl.runs import RunRecord
from tests.rl.loop_helpers import ParitySource, tiny_config


def _model():
    return build_model(builtin_config("tiny-moe"), seed=0)


def test_resolve_train_on_the_cpu():
    model = _model()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    r = resolve_train(tiny_config(recipe="mxfp8", engine_tile=16), model)
    assert r.plan == resolve("mxfp8", shapes) and r.plan.recipe_name == "mxfp8"
    k = r.kernels
    assert k.device == torch.device("cpu")
    assert (k.quantizer, k.rollout_gemm, k.attention, k.rowwise, k.sampler) == (
        Backend.REFERENCE,
    ) * 5
    assert k.train_gemm is Gemm.REFERENCE
    assert r.compute_dtype is torch.float32
    e = r.engine
    assert (e.device, e.tile, e.compute_dtype, e.backend) == (
        torch.device("cpu"), 16, torch.float32, k,
    )  # fmt: skip


def test_resolve_train_takes_the_configured_compute_dtype_and_device():
    r = resolve_train(tiny_config(compute_dtype="bfloat16", device="cpu"), _model())
    assert r.compute_dtype is torch.bfloat16 and r.engine.compute_dtype is torch.bfloat16
    # a rank of a placement passes its own device
    assert resolve_train(tiny_config(), _model(), torch.device("cpu")).engine.device.type == "cpu"


def test_a_backend_the_device_cannot_run_is_refused_before_anything_is_built(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = _model()
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_train(tiny_config(backend="triton"), model)
    assert not any(isinstance(m, QLinear | QExperts) for m in model.modules())


def test_a_trainer_handed_the_run_resolves_nothing_again(tmp_path, monkeypatch):
    """The trainer applies and serves the plan and kernels it is handed: here mxfp8 while its
    config names nvfp4-dequantized (only a caller that resolved the run itself can do that)."""
    cfg, model = tiny_config(steps=1), _model()
    resolved = resolve_train(tiny_config(recipe="mxfp8"), model)

    def again(*args, **kwargs) -> Resolved:
        raise AssertionError("the trainer resolved the run again")

    monkeypatch.setattr(trainer_mod, "resolve_train", again)
    record = RunRecord.create(tmp_path, "r", config={})
    trainer = GRPOTrainer(
        cfg, model, ParitySource(ArithmeticTask(seed=0)), record, resolved=resolved
    )
    assert trainer.plan is resolved.plan and trainer.engine.plan is resolved.plan
    assert trainer.engine.kernels is resolved.kernels
    swapped = {m.spec.format.value for m in model.modules() if isinstance(m, QLinear)}
    assert swapped == {"mxfp8"}
    assert trainer.train_step()["grad/norm"] > 0


def test_a_trainer_without_one_resolves_it_from_its_config(tmp_path):
    cfg, model = tiny_config(steps=1, recipe="mxfp8"), _model()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    record = RunRecord.create(tmp_path, "r", config={})
    trainer = GRPOTrainer(cfg, model, ParitySource(ArithmeticTask(seed=0)), record)
    assert trainer.plan == resolve("mxfp8", shapes) and trainer.engine.plan is trainer.plan
