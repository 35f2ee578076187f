"""Shared helpers for the benchmark scripts: timing, the device's copy bandwidth, the results
file (docs/design.md §9: achieved GB/s and the ratio to a baseline measured in the same run),
and the checks of `--presets` / `--device` every script makes."""

from __future__ import annotations

import datetime as _dt
import difflib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def ensure_repo_on_path() -> None:
    """Let `python benchmarks/<script>.py` import mxrl from a checkout that is not installed."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


TIMING = {"method": None}  # how the last bench_ms timed (recorded in the results file)


def bench_ms(fn: Callable[[], object], *, quick: bool = False, graph: bool = True) -> float:
    """Median milliseconds of fn() on the current CUDA device.

    graph=True (default) replays fn captured in a CUDA graph (triton's do_bench_cudagraph), so
    the Python launch overhead of a ~0.1 ms kernel is not timed; where capture fails, or with
    graph=False, triton's do_bench (L2 flushed between runs), else CUDA events."""
    warmup, rep = (5, 20) if quick else (25, 100)
    try:
        from triton.testing import do_bench, do_bench_cudagraph
    except ImportError:
        do_bench = do_bench_cudagraph = None
    if graph and do_bench_cudagraph is not None:
        try:
            fn()  # compile / autotune outside the capture
            torch.cuda.synchronize()
            ms = float(do_bench_cudagraph(fn, rep=rep, return_mode="median"))
            TIMING["method"] = "cuda_graph"
            return ms
        except Exception as err:  # capture is best effort: say so and fall back
            print(f"  (cuda-graph timing failed: {type(err).__name__}; timing eagerly)")
    if do_bench is not None:
        TIMING["method"] = "do_bench"
        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    TIMING["method"] = "events"
    return _bench_events(fn, warmup=warmup, rep=rep)


def _bench_events(fn: Callable[[], object], *, warmup: int, rep: int) -> float:
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    one = max(start.elapsed_time(end), 1e-3)
    n_warm, n_rep = max(1, int(warmup / one)), max(5, int(rep / one))
    for _ in range(n_warm):
        fn()
    times = []
    for _ in range(n_rep):
        flush.zero_()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def load_hf(path: Path, dtype: torch.dtype = torch.bfloat16) -> tuple[object, str]:
    """(transformers model on the CPU, experts implementation) of the checkpoint at `path`:
    grouped_mm experts where this transformers takes the option, else its eager experts (said
    on stdout)."""
    import transformers

    kwargs = {"dtype": dtype, "experts_implementation": "grouped_mm"}
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs), "grouped_mm"
    except (TypeError, ValueError) as err:
        print(f"  (transformers refused experts_implementation=grouped_mm: {err}; eager)")
        kwargs.pop("experts_implementation")
        return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs), "eager"


def decode_timing(t_n: list[float], t_1: list[float], batch: int, new_tokens: int) -> dict:
    """A decode row's timing from the timed calls of `new_tokens` and of one token (medians):
    the decode step by difference, None where timing noise exceeds the decode time (a loaded
    CPU: no estimate rather than a wild one)."""
    total_s, prefill_s = statistics.median(t_n), statistics.median(t_1)
    n = new_tokens
    step_ms = (total_s - prefill_s) / (n - 1) * 1e3 if total_s > prefill_s else None
    return {
        "batch": batch,
        "total_s": total_s,
        "prefill_plus_one_s": prefill_s,
        "ms_per_step": step_ms,
        "tokens_per_s": batch * n / total_s,
        "decode_tokens_per_s": None if step_ms is None else batch / (step_ms * 1e-3),
    }


def gbps(num_bytes: int, ms: float) -> float:
    return num_bytes / (ms * 1e-3) / 1e9


def copy_bandwidth(like: torch.Tensor, *, quick: bool = False) -> dict:
    """GB/s of `dst.copy_(x)` for a tensor of x's size and dtype, counting bytes read + written
    (dst allocated once, outside the timing)."""
    src = torch.empty_like(like).normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), quick=quick)
    num_bytes = 2 * src.numel() * src.element_size()
    return {"bytes": num_bytes, "ms": ms, "gbps": gbps(num_bytes, ms)}


def environment() -> dict:
    """Device and versions, recorded with every result."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    props = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0),
        "device_sm": f"sm_{props.major}{props.minor}",
        "num_sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def update_results(path: Path, key: str, section: object, metadata: dict) -> None:
    """Write `section` under `key` of the JSON file at path, and refresh the top-level metadata;
    other keys (other benchmarks' sections) are kept."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(metadata)
    data[key] = section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec); None prints as '-'."""
    header = [h for _, h, _ in columns]
    body = [
        ["-" if row.get(k) is None else format(row[k], spec) for k, _, spec in columns]
        for row in rows
    ]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def check_presets(names: list[str]) -> None:
    """Stop with the close names (and the list) on a preset mxrl.recipe does not have."""
    from mxrl.recipe import list_presets  # after ensure_repo_on_path, in the scripts

    available = list_presets()
    for name in names:
        if name not in available:
            close = difflib.get_close_matches(name, available, n=3, cutoff=0.5)
            close += [p for p in available if p.startswith(name) and p not in close]
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise SystemExit(
                f"unknown preset {name!r}{hint} (available: {', '.join(available)}; "
                "`mxrl recipe list` describes them)"
            )


def check_device(name: str) -> torch.device:
    """The torch device `--device` names, or stop with what is wrong (no CUDA, no such index)."""
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise SystemExit(f"--device {name!r}: {err}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {name}: torch sees no CUDA device; use --device cpu")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise SystemExit(
                f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise SystemExit(f"--device {name}: only cuda and cpu are supported")
    return device


def cpu_environment() -> dict:
    """What `environment()` records, for a run on the CPU."""
    return {
        "device": f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def allocator_counts(device: torch.device | str) -> dict[str, int]:
    """The CUDA caching allocator's cumulative device allocations, frees and retries on `device`
    (each cudaMalloc / cudaFree waits for the device); none elsewhere."""
    if torch.device(device).type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    names = ("num_device_alloc", "num_device_free", "num_alloc_retries")
    return {n: stats.get(n, 0) for n in names}


def synced(device: torch.device) -> float:
    """time.perf_counter() once the work queued on `device` is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def profile_call(
    fn: Callable[[], object], device: torch.device, label: str, rows: int = 14
) -> None:
    """One call of fn (after one unprofiled call, timed with the allocator's device allocations,
    frees and retries, beside a second) under torch.profiler and cProfile, printed: its
    wall time, the device's busy time (kernels and copies) and the kernels that took it, then the
    host's side: the Python functions of mxrl, triton and torch by cumulative time (cProfile's
    own overhead included, so read shares, not milliseconds)."""
    import cProfile
    import pstats

    before = allocator_counts(device)
    t0 = synced(device)
    fn()
    first = synced(device) - t0
    between = allocator_counts(device)
    t0 = synced(device)
    fn()
    plain = synced(device) - t0
    after = allocator_counts(device)
    if before:  # cudaMalloc / cudaFree calls and allocator retries in each call (synchronous)
        calls = {k: (between[k] - before[k], after[k] - between[k]) for k in before}
        print(f"  profile {label}: first call {first * 1e3:.1f} ms, the next {plain * 1e3:.1f} "
              f"ms; allocator (first, next): {calls}")  # fmt: skip
    profile_once(fn, device, label, rows, plain=plain, host=False)
    host = cProfile.Profile()
    host.enable()
    fn()
    synced(device)
    host.disable()
    stats = pstats.Stats(host)
    stats.sort_stats("cumulative").print_stats(r"mxrl|triton/runtime|torch/cuda", 40)


def profile_once(
    fn: Callable[[], object],
    device: torch.device,
    label: str,
    rows: int = 14,
    *,
    plain: float | None = None,
    host: bool = True,
) -> object:
    """fn() once under torch.profiler (and, host, cProfile at the same time), printed as
    `profile_call` prints; returns fn's result. For a call that cannot be repeated as it ran
    (the loop's sync inside a step); `plain`: the unprofiled wall time, when one was taken."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    python = cProfile.Profile()
    with profile(activities=activities) as prof:
        t0 = synced(device)
        if host:
            python.enable()
        out = fn()
        wall = synced(device) - t0
        if host:
            python.disable()
    events = prof.key_averages()
    # the kernels' and copies' own events (an aten op's device time repeats its kernels')
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    unprofiled = "" if plain is None else f"{plain * 1e3:.1f} ms unprofiled, "
    print(f"  profile {label}: wall {unprofiled}{wall * 1e3:.1f} ms profiled, device busy "
          f"{busy * 1e3:.1f} ms")  # fmt: skip
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=rows, max_name_column_width=60))
    if host:
        stats = pstats.Stats(python)
        stats.sort_stats("cumulative").print_stats(r"mxrl|triton/runtime|torch/cuda", 40)
    return out
