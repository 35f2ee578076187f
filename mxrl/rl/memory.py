"""The memory a `mxrl train` run needs, known before the model loads (docs/rl.md, "Memory").

    est = estimate_memory(model_cfg, plan, cfg, prompt_tokens=120, capacity=device_capacity("cuda"))
    est.check()                  # ValueError naming the knob, or the run fits
    est.micro_batch_tokens       # the training pass's budget (rl.max_tokens_per_micro_batch)

One process holds, for the whole run: the master weights, their gradients, AdamW's two moments,
the training ops' quantized weight copies, the engine's weights and its KV cache. The training
pass adds one micro-batch's activations (bytes per padded token x its tokens) and one logits
chunk. Each term is computed from the model config, the plan and the rl config, not measured;
the activation count follows what autograd saves in mxrl.models (tests/rl/test_memory.py checks
it against a real backward). Nothing here imports torch at module level: preflight runs it
before the model exists.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from mxrl.rl.choices import ComputeDtype
from mxrl.rl.config import TrainConfig
from mxrl.rl.memory_terms import (
    activation_bytes,
    engine_weight_bytes,
    expert_input_bytes,
    kv_cache_bytes,
    logits_chunk_bytes,
    train_copy_bytes,
)

# of the device's bytes, what the run may plan for: the rest is the allocator's fragmentation,
# the CUDA context and kernel workspaces, none of which the terms below count
SAFETY = 0.9
ROUND_TOKENS = 256  # a derived micro-batch budget is a multiple of this (or the longest sequence)
GIB, MIB = 1 << 30, 1 << 20


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank (the worst rank of a placement). `micro_batch_tokens`: the training
    pass's budget in padded tokens (given, derived from `capacity`, or the whole step's tokens
    when the capacity is unknown); `capacity`: the device's bytes (None: unknown)."""

    device: str
    capacity: int | None
    master_weights: int
    gradients: int
    optimizer: int
    train_weight_copies: int  # quantized weight caches and autocast's bf16 casts
    engine_weights: int
    kv_cache: int
    activation_bytes_per_token: int  # saved for the backward + one layer's working set
    logits_chunk: int
    micro_batch_tokens: int
    budget: str  # "given" | "derived" | "whole step"
    longest_sequence: int
    step_tokens: int  # this rank's padded tokens of one step (the whole batch)
    colocated: bool  # the trainer and the engine share the device
    checkpoint_layers: bool
    one_sequence_with_checkpointing: int  # activation bytes of the longest sequence with it
    # what the bf16 routed experts' copies held per optimizer step take (rl.hold_bf16_weights,
    # decided here for auto: held where the run fits with them); 0: none held, or none to hold
    held_bf16_bytes: int = 0
    not_held_bytes: int = 0  # auto: what the copies would take where the run does not fit with them

    @property
    def hold_bf16_weights(self) -> bool:
        """The trainer holds the bf16 expert copies (what `mxrl train` hands it for auto)."""
        return self.held_bf16_bytes > 0

    @property
    def train_fixed(self) -> int:
        return self.master_weights + self.gradients + self.optimizer + self.train_weight_copies

    @property
    def rollout_fixed(self) -> int:
        return self.engine_weights + self.kv_cache

    @property
    def fixed(self) -> int:
        """What lives for the whole run on the busiest rank."""
        if self.colocated:
            return self.train_fixed + self.rollout_fixed
        return max(self.train_fixed, self.rollout_fixed)

    @property
    def train_side(self) -> int:
        """What a training rank holds besides the training pass."""
        return self.train_fixed + (self.rollout_fixed if self.colocated else 0)

    @property
    def activations(self) -> int:
        return self.activation_bytes_per_token * self.micro_batch_tokens

    @property
    def rollout_peak(self) -> int:
        return self.rollout_fixed + (self.train_fixed if self.colocated else 0)

    @property
    def train_peak(self) -> int:
        return self.train_side + self.activations + self.logits_chunk

    @property
    def peak(self) -> int:
        return max(self.rollout_peak, self.train_peak)

    @property
    def usable(self) -> int | None:
        return None if self.capacity is None else int(self.capacity * SAFETY)

    def lines(self) -> list[str]:
        """The estimate as printed at the start of a run."""
        of = "unknown size" if self.capacity is None else f"{self.capacity / GIB:.1f} GiB"
        copies = (
            f" + train copies {_g(self.train_weight_copies)}" if self.train_weight_copies else ""
        )
        where = "" if self.colocated else " (split: the larger of train and rollout ranks)"
        ckpt = ", checkpoint_layers" if self.checkpoint_layers else ""
        if self.held_bf16_bytes:
            copies += f" (held bf16 expert copies {_g(self.held_bf16_bytes)})"
        elif self.not_held_bytes:
            copies += (
                f" (bf16 expert copies not held: their {_g(self.not_held_bytes)} GiB do not fit; "
                "rl.hold_bf16_weights auto)"
            )
        return [
            f"memory (estimate, {self.device} of {of}): weights {_g(self.master_weights)} + grads "
            f"{_g(self.gradients)} + AdamW {_g(self.optimizer)}{copies} + engine weights "
            f"{_g(self.engine_weights)} + KV {_g(self.kv_cache)} GiB fixed{where}; training "
            f"{self.activation_bytes_per_token / MIB:.2f} MiB/token x {self.micro_batch_tokens}"
            f"-token micro-batches ({self.budget}{ckpt}) = {_g(self.activations)} GiB; logits "
            f"chunk {_g(self.logits_chunk)} GiB; peak {_g(self.peak)} GiB",
        ]

    def fields(self) -> dict[str, Any]:
        """Every byte count, and the peaks: the run record's `memory_estimate` event."""
        peaks = {"rollout_peak": self.rollout_peak, "train_peak": self.train_peak}
        held = {"hold_bf16_weights": self.hold_bf16_weights}
        return {**dataclasses.asdict(self), **held, **peaks, "peak": self.peak}

    def check(self) -> None:
        """ValueError naming the knob to turn when the run cannot fit (or its budget is below
        one sequence); nothing when it fits or the capacity is unknown."""
        seq, tokens = self.longest_sequence, self.micro_batch_tokens
        if self.budget == "given" and tokens < seq:
            raise ValueError(
                f"rl.max_tokens_per_micro_batch: {tokens} is less than the longest sequence "
                f"({seq} tokens: the longest prompt + rl.max_new_tokens); set it >= {seq}, or 0 "
                "to derive it from memory"
            )
        usable = self.usable
        if usable is None:
            return
        head = f"memory: the run needs more than {self.device}'s {_g(usable)} GiB usable"
        head += f" ({SAFETY:.0%} of {_g(self.capacity)} GiB)"
        unhold = (
            f"set rl.hold_bf16_weights: false or auto (frees {_g(self.held_bf16_bytes)} GiB), "
            if self.held_bf16_bytes
            else ""
        )
        if max(self.train_side + self.logits_chunk, self.rollout_fixed) > usable:
            raise ValueError(
                f"{head} before any activation: weights {_g(self.master_weights)} + grads "
                f"{_g(self.gradients)} + AdamW {_g(self.optimizer)} + train copies "
                f"{_g(self.train_weight_copies)} + engine weights {_g(self.engine_weights)} + KV "
                f"{_g(self.kv_cache)} GiB; {unhold}lower rl.prompts_per_step, "
                "rl.samples_per_prompt or rl.max_new_tokens (the KV cache), set dtype: bfloat16 "
                "(halves weights, grads and AdamW), choose a smaller rl.recipe (engine weights), "
                "or shard over more ranks (placement, docs/scale.md)"
            )
        left = usable - self.train_side - self.logits_chunk
        one = self.activation_bytes_per_token * seq
        if one > left:
            fix = (
                f"set rl.checkpoint_layers: true (then {_g(self.one_sequence_with_checkpointing)} "
                "GiB), or "
                if not self.checkpoint_layers
                else ""
            )
            raise ValueError(
                f"{head}: one sequence of {seq} tokens needs {_g(one)} GiB of activations and "
                f"{_g(left)} GiB are left after the weights, optimizer and rollout; {fix}{unhold}"
                "lower rl.max_new_tokens, rl.prompts_per_step or rl.samples_per_prompt, or shard "
                "over more ranks (placement, docs/scale.md)"
            )
        if self.activations > left:
            fits = left // self.activation_bytes_per_token
            raise ValueError(
                f"{head}: rl.max_tokens_per_micro_batch {tokens} needs {_g(self.activations)} "
                f"GiB of activations and {_g(left)} GiB are left; set it <= {fits}, or 0 to "
                "derive it from memory"
            )


def estimate_memory(
    model_cfg: Any, plan: Any, train_cfg: TrainConfig, *, prompt_tokens: int, capacity: int | None
) -> MemoryEstimate:
    """The estimate for this config (`MemoryEstimate`); `prompt_tokens`: the longest prompt's
    tokens; `capacity`: the device's bytes (`device_capacity`), None if unknown.

    rl.hold_bf16_weights auto: the estimate with the held bf16 expert copies where it fits (or
    the capacity is unknown), else the one without them (whose check then says what fails)."""
    hold = train_cfg.rl.hold_bf16_weights
    if hold is True or hold is False:
        return _estimate(model_cfg, plan, train_cfg, prompt_tokens, capacity, hold)
    held = _estimate(model_cfg, plan, train_cfg, prompt_tokens, capacity, True)
    try:
        held.check()
    except ValueError:
        cast = _estimate(model_cfg, plan, train_cfg, prompt_tokens, capacity, False)
        return dataclasses.replace(cast, not_held_bytes=held.held_bf16_bytes)
    return held


def _estimate(
    model_cfg: Any,
    plan: Any,
    train_cfg: TrainConfig,
    prompt_tokens: int,
    capacity: int | None,
    hold: bool,
) -> MemoryEstimate:
    rl = train_cfg.rl
    cuda = rl.device.startswith("cuda")
    master = 4 if train_cfg.dtype == "float32" else 2
    # the engine's dtype and the training autocast's (GRPOConfig.compute_dtype); without
    # autocast the training ops compute in the master's dtype
    bf16 = rl.compute_dtype == ComputeDtype.BFLOAT16
    engine = 2 if bf16 or (rl.compute_dtype == ComputeDtype.AUTO and cuda) else 4
    compute = min(engine, master)
    train_ranks, rollout_ranks, colocated = _ranks(train_cfg)
    numel = sum(math.prod(s.shape) for s in plan.values())
    seq = prompt_tokens + rl.max_new_tokens
    experts = expert_input_bytes(plan, model_cfg, cuda)
    per_token = sum(
        activation_bytes(model_cfg, master, compute, cuda, seq, rl.checkpoint_layers, experts)
    )
    with_ckpt = sum(activation_bytes(model_cfg, master, compute, cuda, seq, True, experts))
    sequences = math.ceil(rl.prompts_per_step / train_ranks) * rl.samples_per_prompt
    hold = hold and not train_cfg.placement  # one process only (FSDP2 casts per use)
    copies = train_copy_bytes(plan, model_cfg, master, compute, cuda, hold) // train_ranks
    held = copies - train_copy_bytes(plan, model_cfg, master, compute, cuda) // train_ranks
    est = MemoryEstimate(
        device=rl.device,
        capacity=capacity,
        master_weights=numel * master // train_ranks,
        gradients=numel * master // train_ranks,
        optimizer=2 * numel * master // train_ranks,  # fused AdamW: exp_avg, exp_avg_sq
        train_weight_copies=copies,
        engine_weights=engine_weight_bytes(plan, engine, cuda),
        kv_cache=kv_cache_bytes(
            model_cfg, rl, seq, engine, cuda, rollout_ranks, plan.kv_cache == "fp8"
        ),
        activation_bytes_per_token=per_token,
        logits_chunk=logits_chunk_bytes(model_cfg.vocab_size, sequences * seq),
        micro_batch_tokens=rl.max_tokens_per_micro_batch,
        budget="given",
        longest_sequence=seq,
        step_tokens=sequences * seq,
        colocated=colocated,
        checkpoint_layers=rl.checkpoint_layers,
        one_sequence_with_checkpointing=with_ckpt * seq,
        held_bf16_bytes=held,
    )
    if rl.max_tokens_per_micro_batch:
        return est
    tokens, how = est.step_tokens, "whole step"
    if est.usable is not None:
        left = est.usable - est.train_side - est.logits_chunk
        fits = max(left, 0) // per_token
        if fits < est.step_tokens:
            tokens, how = fits // ROUND_TOKENS * ROUND_TOKENS, "derived"
            tokens = max(tokens, seq) if fits >= seq else fits  # fits < seq: check refuses
    return dataclasses.replace(est, micro_batch_tokens=tokens, budget=how)


def device_capacity(device: str) -> int | None:
    """The device's bytes: a GPU's total memory (`cuda` without an index: this torchrun rank's
    GPU, LOCAL_RANK); on the CPU, MemAvailable (/proc/meminfo), or None where it cannot be
    read. The device properties, not `mem_get_info`: no CUDA context is created before the
    run picks its device."""
    if device.startswith("cuda"):
        import torch

        index = torch.device(device).index
        index = int(os.environ.get("LOCAL_RANK", "0")) if index is None else index
        return int(torch.cuda.get_device_properties(index).total_memory)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _g(n: int | None) -> str:
    return f"{(n or 0) / GIB:.1f}"


def _ranks(cfg: TrainConfig) -> tuple[int, int, bool]:
    """(train ranks, rollout ranks, colocated). FSDP2 shards weights, grads and AdamW evenly
    over the train ranks; each rollout rank holds a whole engine and its share of the groups."""
    p = cfg.placement
    if p is None:
        return 1, 1, True
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if p.mode == "split":
        return p.train_ranks, p.rollout_ranks, False
    ranks = p.train_ranks or world
    return ranks, p.rollout_ranks or ranks, True
