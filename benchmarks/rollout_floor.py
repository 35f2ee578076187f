"""Where a rollout's time went, against what it had to read: the engine's decode-only steps
binned by how many sequences each decoded, each bin with its byte floor (the weights the live
requests were routed to and the K/V the steps read). `benchmarks/rl_step.py`'s `rollout_parts`
rows (docs/benchmarks.md, "The RL step")."""

from __future__ import annotations

from engine_decode import weight_bytes_by_position
from families import kv_token_bytes

# the decode steps of a rollout by how many sequences each decoded (upper bounds of the bins)
ROW_BINS = (16, 32, 64, 128, 256)


def rollout_parts(stats, rollout_s: float, floor_bytes=None, copy_gbps=None) -> dict:
    """Where one rollout's time went, from the engine's clock (`GenerateStats`): its decode-only
    steps by how many sequences each decoded (seconds, steps, ms a step, mean keys a sequence
    read), and the rest (prefill and steps that mixed prefill with decode, the scheduling before
    the first step, the completions after the last) as `other_s`. floor_bytes: what each
    decode-only step had to read (`step_floor_bytes`), summed per bin; with `copy_gbps` (the
    copy rate of the run) the bin's floor in seconds and its time over it, `x_floor`."""
    bins = []
    low = 1
    floor_bytes = floor_bytes or [None] * len(stats.decode_step_s)
    steps = list(zip(stats.decode_step_s, stats.decode_step_rows, stats.decode_step_keys,
                     floor_bytes, strict=True))  # fmt: skip
    for high in (*ROW_BINS, max([*stats.decode_step_rows, ROW_BINS[-1]])):
        if high < low:
            continue
        picked = [step for step in steps if low <= step[1] <= high]
        if picked:
            seconds = sum(t for t, _, _, _ in picked)
            part = {"rows": f"{low}-{high}", "steps": len(picked), "s": seconds,
                    "ms_per_step": 1e3 * seconds / len(picked),
                    "keys_per_row": sum(k for _, _, k, _ in picked)
                    / sum(r for _, r, _, _ in picked)}  # fmt: skip
            if picked[0][3] is not None:
                part["floor_bytes"] = sum(b for _, _, _, b in picked)
                if copy_gbps:
                    part["floor_s"] = part["floor_bytes"] / (copy_gbps * 1e9)
                    part["x_floor"] = seconds / part["floor_s"]
            bins.append(part)
        low = high + 1
    decode = sum(stats.decode_step_s)
    return {"decode_s": decode, "decode_steps": len(stats.decode_step_s),
            "other_s": rollout_s - decode, "by_rows": bins}  # fmt: skip


def step_floor_bytes(engine, outs, prompt_len: int) -> list[float]:
    """What each decode-only step of the rollout that made `outs` had to read: the weights of
    the step's position with the requests in lockstep (`weight_bytes_by_position`: decode-only
    step i taken as position prompt + i; the requests start within a few steps of each other,
    a GRPO group's samples one step apart, against thousands of steps) and the K/V of the keys
    the step read (`GenerateStats.decode_step_keys`, every layer, in the cache's format)."""
    stats, config = engine.stats, engine.config
    weights = weight_bytes_by_position(engine, outs, prompt_len)
    kv = config.num_hidden_layers * kv_token_bytes(config, engine._kv, engine._kv.dtype)
    return [weights[min(i, len(weights) - 1)] + kv * keys
            for i, keys in enumerate(stats.decode_step_keys)]  # fmt: skip
