"""benchmarks/step_breakdown.py: kernels named by hand go where the table says, a backward op
is charged to the range of the forward op it differentiates, and a tiny model's step under the
profiler fills the categories its parts run in (on the CPU: ops stand for kernels)."""

from __future__ import annotations

import json

import torch

from tests.benchmark_scripts import load_benchmark


def test_kernel_names_and_ranges_pick_the_category(monkeypatch):
    sb = load_benchmark("step_breakdown", monkeypatch)
    cases = [  # (kernel, range role, category): names from an H200 profile of the step
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "attention", "gemm"),
        ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel", "moe", "gemm"),
        ("fp8_block_grouped_kernel", None, "gemm"),
        ("_quantize_mxfp8_kernel", "moe", "quantization"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma", "attention", "attention"),
        ("void at::native::vectorized_elementwise_kernel<8, bfloat16_copy_kernel_cuda", "moe",
         "casts"),
        ("_widen_bf16_kernel", None, "casts"),
        ("void at::native::indexFuncLargeIndex<c10::BFloat16, long>", "moe", "permutation"),
        ("void at::native::vectorized_gather_kernel<16, long>", "moe", "permutation"),
        ("void at::native::elementwise_kernel<silu>", "moe", "norms/activations"),
        ("void at::native::reduce_kernel<128, 4>", "norm", "norms/activations"),
        ("void at::native::reduce_kernel<128, 4>", "router", "router"),
        ("void at::native::elementwise_kernel<rotary>", "attention", "attention"),
        ("multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer", "optimizer"),
        ("void at::native::cunn_SoftMaxBackward<4, float>", None, "loss"),
        ("void at::native::nll_loss_forward_reduce_cuda_kernel_2d", None, "loss"),
        ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", None,
         "other"),
    ]  # fmt: skip
    for kernel, role, want in cases:
        assert sb.classify(kernel, role) == want, (kernel, role)
    assert set(sb.CATEGORIES) >= {want for _, _, want in cases}


def test_a_backward_op_is_charged_to_its_forward_ops_range(monkeypatch):
    sb = load_benchmark("step_breakdown", monkeypatch)
    from torch.profiler import ProfilerActivity, profile, record_function

    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("mxrl::norm"):
            y = torch.sigmoid(x @ w)
        y.sum().backward()
    events = prof.events()
    roles = sb.forward_roles(events)
    nodes = [e for e in events if e.name.startswith("autograd::engine::evaluate_function: ")]
    by_node = {e.name.split(": ", 1)[1]: sb._range_of(e, roles) for e in nodes}
    assert by_node["SigmoidBackward0"] == "norm" and by_node["MmBackward0"] == "norm"
    assert by_node["SumBackward0"] is None  # its forward op ran outside every range


def test_a_tiny_step_fills_its_categories_and_the_row_carries_them(tmp_path, monkeypatch):
    train_step = load_benchmark("train_step", monkeypatch)
    out = tmp_path / "results.json"
    args = ["--tiny", "--device", "cpu", "--layers", "2", "--shapes", "2x8", "--presets", "bf16",
            "--warmup", "1", "--repeats", "1", "--skip-hf", "--optimizer", "--breakdown",
            "--out", str(out)]  # fmt: skip
    assert train_step.main(args) == 0
    section = json.loads(out.read_text())["train_step"]
    assert section["optimizer"].startswith("adamw fused")
    (row,) = section["rows"]
    ms = row["breakdown_ms"]
    for category in ("gemm", "attention", "router", "permutation", "norms/activations", "loss",
                     "optimizer"):  # fmt: skip
        assert ms[category] > 0, (category, ms)
    assert "s_step_fresh" not in row  # with the optimizer every step is a fresh one
