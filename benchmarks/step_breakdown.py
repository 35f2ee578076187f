"""Where a training step's GPU time goes, by operation: attention, router, MoE permutation,
GEMMs, quantization, norms and activations, casts, loss, optimizer (issue 29's breakdown).

Kernels do not say which operation launched them, so the profile is read in two steps:

1. **Where**: while profiling, forward hooks open a `record_function` range around each module
   of a known role (`ROLES`: attention, the router's gate and selection, the routed experts, the
   dense and shared MLPs, the norms, the embedding) and the caller wraps the optimizer in
   `OPTIMIZER_RANGE`. A kernel belongs to the innermost range around the CPU op that launched it.
   A backward kernel is launched by an autograd node (`autograd::engine::evaluate_function: X`)
   whose sequence number is that of the forward op it differentiates: it belongs to that forward
   op's range (activation recomputation under checkpointing runs inside the forward hooks too).
2. **What**: the kernel's name decides first where it is unambiguous (`KERNEL_RULES`, in order:
   GEMMs, quantization kernels, attention kernels, dtype casts); otherwise the range's role
   decides, and inside the MoE the name splits permutation (gathers, scatters, sorts, index
   copies) from activations and the routing weights' products.

What no range and no rule claims is `other` (the embedding's gather, the residual adds between
blocks, the logits' cast). The rules are plain substrings of kernel names on the H200 (torch
2.11, CUDA 13): read them with the table they produce.

`profile_step` is the older, coarser view: GPU time per kernel name, and the GEMM kernels' share
(train_step.py's `--profile`).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch import nn

CATEGORIES = (
    "gemm",
    "attention",
    "router",
    "permutation",
    "quantization",
    "norms/activations",
    "casts",
    "loss",
    "optimizer",
    "other",
)
OPTIMIZER_RANGE = "mxrl::optimizer"
_PREFIX = "mxrl::"

# (category, substrings of the lowercased kernel name), first match wins
KERNEL_RULES = (
    # (on the CPU, where ops stand for kernels: aten's matmuls)
    (
        "gemm",
        (
            "gemm",
            "xmma",
            "cutlass",
            "nvjet",
            "grouped_kernel",
            "kgrouped",
            "_mm_kernel",
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "grouped_mm",
        ),
    ),
    ("quantization", ("quant", "e4m3", "mxfp8", "nvfp4", "fp8_block", "amax", "scale_kernel")),
    ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("casts", ("bfloat16_copy", "float_copy", "widen", "_to_copy", "bfloat16_to", "to_bf16")),
)
LOSS_MARKS = ("nll_loss", "softmax", "cross_entropy", "logsumexp")
PERMUTATION_MARKS = (
    "index", "gather", "scatter", "sort", "cumsum", "bincount", "histc", "catarray", "cat_",
    "repeat_interleave", "nonzero", "arange", "direct_copy", "put_",
)  # fmt: skip


def _role(name: str, module: nn.Module) -> str | None:
    """The range a module's forward opens (None: no range of its own)."""
    from mxrl.models.layers import MLP, Attention, RMSNorm, RoutedBlock, TopKSoftmax
    from mxrl.models.mla import MLAttention, SigmoidRouter
    from mxrl.nn.experts import GroupedExperts

    if isinstance(module, Attention | MLAttention):
        return "attention"
    if isinstance(module, TopKSoftmax | SigmoidRouter) or name.endswith(".mlp.gate"):
        return "router"
    if isinstance(module, GroupedExperts | RoutedBlock):
        return "moe"
    if isinstance(module, MLP):
        return "mlp"
    if isinstance(module, RMSNorm):
        return "norm"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return None


@contextlib.contextmanager
def module_ranges(model: nn.Module):
    """Open a `record_function` range named `mxrl::<role>` around every module of a known role
    while the block runs (hooks removed after it)."""
    from torch.profiler import record_function

    handles, stack = [], []
    for name, module in model.named_modules():
        role = _role(name, module)
        if role is None:
            continue

        def pre(_m, _args, role=role):
            rf = record_function(_PREFIX + role)
            rf.__enter__()
            stack.append(rf)

        def post(_m, _args, _out):
            stack.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _by_name(kernel: str) -> str | None:
    low = kernel.lower()
    for category, marks in KERNEL_RULES:
        if any(m in low for m in marks):
            return category
    return None


def classify(kernel: str, role: str | None) -> str:
    """A kernel's category from its name and the role of the range it ran in."""
    by_name = _by_name(kernel)
    if by_name is not None:
        return by_name
    low = kernel.lower()
    if role == "optimizer":
        return "optimizer"
    if role in ("attention", "router"):
        return role
    if role == "moe":
        return "permutation" if any(m in low for m in PERMUTATION_MARKS) else "norms/activations"
    if role in ("mlp", "norm"):
        return "norms/activations"
    if any(m in low for m in LOSS_MARKS):
        return "loss"
    return "other"


def _range_of(event, forward_role: dict[int, str]) -> str | None:
    """The innermost mxrl range around a CPU op, through the forward op of a backward node."""
    e = event
    while e is not None:
        if e.name.startswith(_PREFIX):
            return e.name[len(_PREFIX) :]
        if e.name.startswith("autograd::engine::evaluate_function:"):
            return forward_role.get(e.sequence_nr)
        e = e.cpu_parent
    return None


def forward_roles(events) -> dict[int, str]:
    """The range of each forward op, by its sequence number (the number its backward node
    carries)."""
    roles: dict[int, str] = {}
    for e in events:
        if e.sequence_nr < 0 or e.sequence_nr in roles:
            continue
        if e.name.startswith("autograd::engine") or e.name.endswith(("Backward0", "Backward")):
            continue
        role = _range_of(e, {})
        if role is not None:
            roles[e.sequence_nr] = role
    return roles


def breakdown(prof, cuda: bool) -> dict[str, float]:
    """Milliseconds per category of one profiled step (`torch.profiler.profile`'s result): the
    device time of every kernel (on the CPU, where there are none: each op's own time)."""
    events = prof.events()
    forward_role = forward_roles(events)
    ms: dict[str, float] = defaultdict(float)
    for e in events:
        if e.name.startswith(_PREFIX) and not cuda:
            continue
        if cuda:
            work = [(k.name, k.duration) for k in e.kernels]
        else:  # every op's own time (its children's excluded)
            work = [(e.name, e.self_cpu_time_total)]
        if not work:
            continue
        role = _range_of(e, forward_role)
        for name, us in work:
            ms[classify(name, role)] += us / 1e3
    return {c: ms.get(c, 0.0) for c in CATEGORIES}


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_breakdown(step, model: nn.Module, device: torch.device) -> dict[str, float]:
    """One call of `step` under the profiler with the model's ranges open: ms per category."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync_device(device)
    # the CPU ops too on CUDA: a kernel is found through the CPU op that launched it
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with module_ranges(model), profile(activities=activities) as p:
        step()
        sync_device(device)
    return breakdown(p, cuda)


# GEMM kernels by name: cuBLAS (nvjet, xmma), CUTLASS (torch._grouped_mm), our grouped
# block-FP8 kernel; and the attention kernels (cuDNN / flash SDPA)
GEMM_KERNEL_MARKS = (
    "gemm",
    "xmma",
    "cutlass",
    "nvjet",
    "fp8_block_grouped_kernel",
    "fp8_block_kgrouped_kernel",
)
ATTENTION_KERNEL_MARKS = ("sdpa", "flash", "fmha")


def profile_step(step, device: torch.device, label: str, top: int) -> dict:
    """One step under torch.profiler: GPU time per kernel name, and the share of GEMM kernels
    (cuBLAS / CUTLASS / nvjet names and our Triton GEMM kernels) in the step's kernel time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync_device(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step()
        sync_device(device)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [e for e in prof.key_averages() if e.device_type == kind]

    def us(e) -> float:  # on the CPU (the script's logic only): self CPU time of each op
        return e.self_device_time_total if cuda else e.self_cpu_time_total

    events.sort(key=lambda e: -us(e))
    total = sum(us(e) for e in events)

    def share(marks) -> float:
        return sum(us(e) for e in events if any(m in e.key.lower() for m in marks))

    gemm, attention = share(GEMM_KERNEL_MARKS), share(ATTENTION_KERNEL_MARKS)
    launches = sum(e.count for e in events)
    print(f"  profile {label}: {total / 1e3:.1f} ms of kernel time in {launches} kernels, "
          f"GEMM kernels {gemm / 1e3:.1f} ms ({100 * gemm / max(total, 1):.0f} %), "
          f"attention {attention / 1e3:.1f} ms")  # fmt: skip
    for e in events[:top]:
        print(f"    {us(e) / 1e3:8.2f} ms  x{e.count:5d}  {e.key[:100]}")
    return {
        "kernel_ms": total / 1e3,
        "gemm_ms": gemm / 1e3,
        "attention_ms": attention / 1e3,
        "kernels": launches,
    }
