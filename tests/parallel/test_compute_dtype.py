"""A placement computes in the run's compute dtype, as one process does (`rl.compute_dtype`,
resolved once: `mxrl.rl.resolve`): FSDP2's mixed-precision policy per layer, and a split
placement under bf16 compute giving the one-process bf16 run's metrics bit for bit."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from torch.distributed.fsdp import MixedPrecisionPolicy

from mxrl.arch import builtin_config
from mxrl.models import build_model
from mxrl.parallel.parallelize import layer_policy
from mxrl.recipe import resolve
from mxrl.runs import RunRecord
from tests.numeric_env import run_python
from tests.parallel.helpers import tail, torchrun
from tests.rl.loop_helpers import numerics


def _plan():
    """nvfp4-hp on the tiny MoE: layers 0-2 hold NVFP4 tensors, layer 3 is wholly bf16."""
    model = build_model(builtin_config("tiny-moe"), seed=0)
    plan = resolve("nvfp4-hp", {n: p.shape for n, p in model.named_parameters()})
    assert {s.format.value for s in plan.values() if s.layer == 3} == {"bf16"}
    assert "nvfp4" in {s.format.value for s in plan.values() if s.layer == 0}
    return plan


def test_bf16_compute_on_cuda_gathers_bf16_only_where_nothing_is_quantized():
    plan = _plan()
    quantized, plain = (layer_policy(plan, i, "cuda", torch.bfloat16) for i in (0, 3))
    assert (quantized.param_dtype, quantized.reduce_dtype) == (None, torch.float32)
    assert (plain.param_dtype, plain.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_fp32_compute_on_cuda_gathers_fp32_everywhere():
    """`rl.compute_dtype: float32` on a CUDA placement: no bf16 gather (it ran bf16 before)."""
    plan = _plan()
    for layer in (0, 3):
        for compute in (None, torch.float32):
            p = layer_policy(plan, layer, "cuda", compute)
            assert (p.param_dtype, p.reduce_dtype) == (None, torch.float32), (layer, compute)


def test_the_cpu_policy_changes_no_dtype_whatever_the_compute():
    plan = _plan()
    for compute in (None, torch.bfloat16):
        assert layer_policy(plan, 3, "cpu", compute) == MixedPrecisionPolicy()


def _config(tmp: Path, name: str, **top) -> Path:
    data = {
        "model": "builtin:tiny-moe",
        "data": {"source": "builtin:arithmetic", "warmup_steps": 60},
        "out": str(tmp / "runs"),
        "run_id": name,
        "rl": {"recipe": "nvfp4-dequantized", "steps": 2, "prompts_per_step": 4,
               "samples_per_prompt": 4, "max_new_tokens": 8, "engine_tile": 16, "lr": 3e-3,
               "seed": 0, "compute_dtype": "bfloat16"},
        **top,
    }  # fmt: skip
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_split_placement_computes_in_bf16_as_one_process_does(tmp_path):
    """Before, a placement on the CPU ignored `compute_dtype: bfloat16` (fp32 compute) while
    one process ran bf16 autocast: their metrics differed. Now both run the run's dtype."""
    env = {"MXRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    single = run_python(
        ["-m", "mxrl.cli", "train", "--config", str(_config(tmp_path, "single"))],
        env, timeout=300,
    )  # fmt: skip
    assert single.returncode == 0, single.stderr[-4000:]
    split = _config(tmp_path, "split", placement={"mode": "split", "train_ranks": 1,
                                                  "rollout_ranks": 1})  # fmt: skip
    out = torchrun(["-m", "mxrl.cli", "train", "--config", str(split)], env=env)
    assert out.returncode == 0, tail(out)
    want = numerics(RunRecord.open(tmp_path / "runs" / "single").metrics())
    assert [r["step"] for r in want] == [1, 2]
    assert any(r["grad/norm"] > 0 for r in want), "no step had a gradient: vacuous"
    assert numerics(RunRecord.open(tmp_path / "runs" / "split").metrics()) == want
