"""The memory estimate (mxrl/rl/memory.py): its activation count against what autograd really
saves, its weight terms against sums worked out by hand, its refusals and `mxrl train`'s."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
import yaml

from mxrl.app.preflight import longest_prompt, read_dataset
from mxrl.arch import ModelConfig, builtin_config, tensors_from_hf_config
from mxrl.cli import main
from mxrl.models import build_model, save_pretrained
from mxrl.recipe import resolve
from mxrl.rl import memory, memory_terms
from mxrl.rl.config import TrainConfig
from tests.models.configs import CONFIGS

# a 1-layer MoE model whose parameters are easy to count by hand
HAND = {
    "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32, "moe_intermediate_size": 32, "num_experts": 4,
    "num_experts_per_tok": 2, "shared_expert_intermediate_size": 0,
}  # fmt: skip
EXPERTS_MXFP8 = {
    "name": "experts-mxfp8", "default": "bf16",
    "rules": [{"match": {"kind": "routed_expert"}, "format": "mxfp8"}],
}  # fmt: skip


def _hf(**changes) -> dict:
    config = builtin_config("tiny-moe")
    config.update(changes)
    return config


def _estimate(hf: dict, rl: dict, *, capacity: int | None, prompt: int = 8, dtype="float32"):
    cfg = TrainConfig.from_dict({"model": "x", "dtype": dtype, "rl": rl})
    plan = resolve(cfg.rl.recipe, tensors_from_hf_config(hf, "fused"))
    model_cfg = ModelConfig.from_hf(hf)
    return memory.estimate_memory(model_cfg, plan, cfg, prompt_tokens=prompt, capacity=capacity)


def _saved_bytes(model, batch: int, seq: int, autocast: bool) -> int:
    """Bytes of the tensors autograd saves in one forward of the decoder (and a loss on its
    output), each storage once, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator())
    mask = torch.ones(batch, seq, dtype=torch.long)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden, _ = model.model(ids, attention_mask=mask)
        hidden.float().square().mean().backward()
    return sum(n for ptr, n in seen.items() if ptr not in params)


@pytest.mark.parametrize(
    "master, compute, ckpt, shared",
    [
        (torch.float32, None, False, 0),
        (torch.float32, None, False, 32),
        (torch.float32, torch.bfloat16, False, 32),  # fp32 master under bf16 autocast
        (torch.bfloat16, torch.bfloat16, False, 0),
        (torch.float32, None, True, 0),
        (torch.float32, torch.bfloat16, True, 0),
    ],
)
def test_activation_bytes_per_token_match_what_autograd_saves(master, compute, ckpt, shared):
    """The per-token slope of the saved bytes (batch 2 -> 4 at one length, so the attention
    mask's length-dependent part stays inside the slope) against the estimate's saved part.
    Bound: within 10% either way: the estimate counts the head's per-token values (the
    logits' input, the loss's scalars: compute x hidden + 32 bytes) where this measurement has
    a plain fp32 loss on the hidden states (4 x hidden bytes); the rest is counted tensor by
    tensor. The total (with the backward's working set of one layer) is at least the slope."""
    hf = _hf(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        shared_expert_intermediate_size=shared, num_hidden_layers=4, mlp_only_layers=[3],
    )  # fmt: skip
    config = ModelConfig.from_hf(hf)
    model = build_model(config, dtype=master, seed=0).train()
    model.set_training_options(compute_dtype=compute, checkpoint_layers=ckpt)
    seq = 16
    autocast = compute is not None
    slope = (_saved_bytes(model, 4, seq, autocast) - _saved_bytes(model, 2, seq, autocast)) / (
        2 * seq
    )
    master_bytes = 4 if master == torch.float32 else 2
    compute_bytes = 2 if autocast else master_bytes
    saved, working = memory_terms.activation_bytes(
        config, master_bytes, compute_bytes, False, seq, ckpt
    )
    assert 0.9 * slope <= saved <= 1.1 * slope, (saved, slope)
    assert saved + working >= slope


def test_weight_terms_against_hand_counts():
    hf = _hf(**HAND)
    per_layer = {
        "q": 64 * 64, "k": 32 * 64, "v": 32 * 64, "o": 64 * 64, "q_norm": 32, "k_norm": 32,
        "input_ln": 64, "post_ln": 64, "router": 4 * 64,
    }  # fmt: skip
    gate_up, down = 4 * 64 * 64, 4 * 64 * 32  # [E, 2I, H], [E, H, I]
    rest = 64 * 64 + 64 * 64 + 64  # embedding, lm_head, final norm
    numel = sum(per_layer.values()) + gate_up + down + rest
    rl = {"recipe": EXPERTS_MXFP8, "device": "cuda", "prompts_per_step": 2}
    est = _estimate(hf, rl, capacity=None)
    assert est.master_weights == est.gradients == 4 * numel
    assert est.optimizer == 8 * numel  # AdamW: two fp32 moments
    experts = gate_up + down
    # the engine on CUDA: bf16 records 2 bytes; MXFP8 codes 1 byte and an E8M0 scale per 32
    assert est.engine_weights == 2 * (numel - experts) + experts + experts // 32
    # training copies: the experts' packed MXFP8 cache and the bf16 operand it keeps per
    # optimizer step (rl.hold_bf16_weights auto, held where the capacity is unknown), bf16
    # casts of the other matmul weights
    casts = 64 * 64 + 32 * 64 * 2 + 64 * 64 + 4 * 64 + 64 * 64  # q k v o, router, lm_head
    assert est.train_weight_copies == experts + experts // 32 + 2 * experts + 2 * casts
    assert est.held_bf16_bytes == 2 * experts
    # KV: 2 prompts x 8 samples of 8 + 8 tokens, one 16-token block each, + CUDA graphs' scratch
    assert est.kv_cache == (2 * 8 + 1) * 2 * 1 * 16 * 1 * 32 * 2  # k+v, layers, block, K, D, bf16
    bf16 = _estimate(hf, {"device": "cuda"}, capacity=None, dtype="bfloat16")
    assert bf16.master_weights == 2 * numel and bf16.optimizer == 4 * numel


def test_held_bf16_expert_copies_on_one_cuda_process_only():
    """rl.hold_bf16_weights (default auto, held when the capacity is unknown): a bf16 routed
    expert's held copy of its fp32 master, 2 bytes a weight, on CUDA's grouped GEMMs; none on
    the CPU (the loop), with a bf16 master (its cast is itself), when off, or under a placement
    (FSDP2 casts per use)."""
    hf = _hf(**HAND)
    experts = 4 * 64 * 64 + 4 * 64 * 32
    held = _estimate(hf, {"device": "cuda"}, capacity=None)
    cast = _estimate(hf, {"device": "cuda", "hold_bf16_weights": False}, capacity=None)
    assert held.train_weight_copies - cast.train_weight_copies == 2 * experts
    assert held.hold_bf16_weights and held.held_bf16_bytes == 2 * experts
    assert not cast.hold_bf16_weights and cast.held_bf16_bytes == 0
    assert "held bf16 expert copies" in held.lines()[0]
    for rl, dtype in (({"device": "cpu"}, "float32"), ({"device": "cuda"}, "bfloat16")):
        on = _estimate(hf, {**rl, "hold_bf16_weights": True}, capacity=None, dtype=dtype)
        off = _estimate(hf, {**rl, "hold_bf16_weights": False}, capacity=None, dtype=dtype)
        assert on.train_weight_copies == off.train_weight_copies, (rl, dtype)
        assert on.hold_bf16_weights is False and on.held_bf16_bytes == 0  # nothing to hold
    placed = _estimate_placed(hf, {"device": "cuda"}, {"train_ranks": 1, "rollout_ranks": 1})
    unheld = _estimate_placed(
        hf, {"device": "cuda", "hold_bf16_weights": False}, {"train_ranks": 1, "rollout_ranks": 1}
    )
    assert placed.train_weight_copies == unheld.train_weight_copies


@pytest.mark.parametrize(
    ("fmt", "backward", "dtype", "kept"),
    [
        ("mxfp8", "high_precision", "float32", 2),  # HP: the master cast for the dgrad
        ("mxfp8", "high_precision", "bfloat16", 0),  # a bf16 master's cast is itself
        ("nvfp4", "dequantized", "float32", 2),  # DEQ
        ("nvfp4", "dequantized", "bfloat16", 2),
        ("mxfp8", "quantized", "float32", 0),  # its column-wise copy is held already
        ("fp8_block", "quantized", "float32", 0),  # its GEMMs read codes only
    ],
)
def test_a_quantized_expert_keeps_one_bf16_operand_when_held(fmt, backward, dtype, kept):
    """rl.hold_bf16_weights on a quantized routed expert (`mxrl.nn.qlinear.kept_forms`): the
    one bf16 operand its weight keeps per optimizer step, 2 bytes a weight, on CUDA only."""
    hf = _hf(**HAND)
    experts = 4 * 64 * 64 + 4 * 64 * 32
    extra = {"nvfp4": {"activations": "per_token"}, "fp8_block": {"block": [32, 32]}}.get(fmt, {})
    recipe = {
        "name": "experts", "default": "bf16", "backward": backward,
        "rules": [{"match": {"kind": "routed_expert"}, "format": fmt, **extra}],
    }  # fmt: skip
    rl = {"recipe": recipe, "device": "cuda"}
    on = _estimate(hf, {**rl, "hold_bf16_weights": True}, capacity=None, dtype=dtype)
    off = _estimate(hf, {**rl, "hold_bf16_weights": False}, capacity=None, dtype=dtype)
    assert on.train_weight_copies - off.train_weight_copies == kept * experts
    assert on.held_bf16_bytes == kept * experts
    cpu = {**rl, "device": "cpu"}
    on_cpu = _estimate(hf, {**cpu, "hold_bf16_weights": True}, capacity=None, dtype=dtype)
    off_cpu = _estimate(hf, {**cpu, "hold_bf16_weights": False}, capacity=None, dtype=dtype)
    assert on_cpu.train_weight_copies == off_cpu.train_weight_copies


def test_budget_derived_from_capacity_holds_the_longest_sequence():
    hf = _hf()
    whole = _estimate(hf, {"max_new_tokens": 8}, capacity=None)
    assert whole.budget == "whole step" and whole.micro_batch_tokens == whole.step_tokens
    one_seq = whole.activation_bytes_per_token * whole.longest_sequence
    need = whole.train_side + whole.logits_chunk + one_seq
    est = _estimate(hf, {"max_new_tokens": 8}, capacity=int(need / memory.SAFETY) + 1)
    assert est.budget == "derived"
    assert est.longest_sequence <= est.micro_batch_tokens < est.step_tokens
    est.check()
    assert est.train_peak <= est.usable


def test_refusals_name_the_knob():
    hf = _hf()
    small = _estimate(hf, {}, capacity=1 << 20)
    with pytest.raises(ValueError, match=r"rl\.prompts_per_step.*placement"):
        small.check()
    whole = _estimate(hf, {"max_new_tokens": 8}, capacity=None)
    just_fixed = int((whole.train_side + whole.logits_chunk + 1) / memory.SAFETY) + 1
    no_room = _estimate(hf, {"max_new_tokens": 8}, capacity=just_fixed)
    with pytest.raises(ValueError, match=r"rl\.checkpoint_layers: true"):
        no_room.check()
    given = _estimate(hf, {"max_tokens_per_micro_batch": 4}, capacity=None)
    with pytest.raises(ValueError, match=r"rl\.max_tokens_per_micro_batch: 4 is less than"):
        given.check()
    assert whole.lines()[0].startswith("memory (estimate, cpu of unknown size)")


def test_a_placement_shards_the_trainer_and_places_the_engine(monkeypatch):
    """FSDP2 shards weights, grads and AdamW over the train ranks; a split placement's train
    ranks hold no engine (the busiest rank is the larger side), a colocated rank holds both."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    hf, rl = _hf(), {"prompts_per_step": 4}
    one = _estimate(hf, rl, capacity=None)
    split = _estimate_placed(hf, rl, {"mode": "split", "train_ranks": 2, "rollout_ranks": 2})
    assert split.master_weights == one.master_weights // 2 and not split.colocated
    assert split.kv_cache == one.kv_cache // 2  # each rollout rank serves half the groups
    assert split.fixed == max(split.train_fixed, split.rollout_fixed)
    colocated = _estimate_placed(hf, rl, {"mode": "colocated"})  # train_ranks: WORLD_SIZE
    assert colocated.optimizer == one.optimizer // 4 and colocated.colocated
    assert colocated.fixed == colocated.train_fixed + colocated.rollout_fixed


def _estimate_placed(hf: dict, rl: dict, placement: dict):
    cfg = TrainConfig.from_dict({"model": "x", "rl": rl, "placement": placement})
    plan = resolve(cfg.rl.recipe, tensors_from_hf_config(hf, "fused"))
    return memory.estimate_memory(
        ModelConfig.from_hf(hf), plan, cfg, prompt_tokens=8, capacity=None
    )


def test_longest_prompt_of_the_task_and_of_a_dataset(tmp_path):
    """The built-in task's longest problem (BOS + "20+20="); a dataset's longest row tokenized
    as the run will, capped where the build skips a prompt (128 positions - 8 new tokens)."""
    tokenizers = pytest.importorskip("tokenizers")
    builtin = TrainConfig.from_dict({"model": "builtin:tiny-moe"})
    assert longest_prompt(builtin, None, ModelConfig.from_hf(_hf())) == 7
    model = tmp_path / "hf"
    save_pretrained(build_model(CONFIGS["qwen3-tied"], seed=0), model, progress=False)
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", *"0123456789"])}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.save(str(model / "tokenizer.json"))
    rows = [" ".join(["1"] * n) for n in (3, 30, 12)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "label": "1"}) + "\n" for p in rows))
    cfg = TrainConfig.from_dict({"model": str(model), "data": {"source": str(data)}})
    model_cfg = ModelConfig.from_hf(model)
    assert longest_prompt(cfg, read_dataset(cfg), model_cfg) == 30
    data.write_text(json.dumps({"prompt": " ".join(["1"] * 200), "label": "1"}) + "\n")
    assert model_cfg.max_positions == 128
    assert longest_prompt(cfg, read_dataset(cfg), model_cfg) == 128 - 8


def test_mxrl_train_refuses_a_run_that_cannot_fit(tmp_path, monkeypatch, capsys):
    config = {
        "model": "builtin:tiny-moe", "out": str(tmp_path / "runs"),
        "data": {"source": "builtin:arithmetic", "warmup_steps": 1},
        "rl": {"steps": 1, "prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 4},
    }  # fmt: skip
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setattr(memory, "device_capacity", lambda device: 1 << 20)
    assert main(["train", "--config", str(path)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("mxrl: error: memory:"), errors
    assert "rl.prompts_per_step" in errors[0]
    assert not (tmp_path / "runs").exists()


def test_auto_holds_the_bf16_copies_only_where_the_run_fits_with_them():
    """rl.hold_bf16_weights auto: held while the run fits with the copies; where only the run
    without them fits, not held (and said so); true refuses there, naming the knob."""
    hf = _hf(**HAND)
    rl = {"device": "cuda", "max_new_tokens": 8}
    cast = _estimate(hf, {**rl, "hold_bf16_weights": False}, capacity=None)
    held = _estimate(hf, {**rl, "hold_bf16_weights": True}, capacity=None)
    one = cast.activation_bytes_per_token * cast.longest_sequence
    # room for the run without the copies and one sequence, not for the copies too
    need = cast.train_side + cast.logits_chunk + one
    tight = int((need + held.held_bf16_bytes // 2) / memory.SAFETY)
    auto = _estimate(hf, rl, capacity=tight)
    auto.check()
    assert auto.hold_bf16_weights is False and auto.held_bf16_bytes == 0
    assert auto.not_held_bytes == held.held_bf16_bytes
    assert "not held" in auto.lines()[0]
    with pytest.raises(ValueError, match=re.escape("set rl.hold_bf16_weights: false or auto")):
        _estimate(hf, {**rl, "hold_bf16_weights": True}, capacity=tight).check()
    roomy = _estimate(hf, rl, capacity=tight * 4)
    assert roomy.hold_bf16_weights and roomy.not_held_bytes == 0


def test_the_printed_line_names_every_term():
    """The estimate's line, worked out by hand for chosen byte counts (GiB to one decimal)."""
    est = _estimate(_hf(**HAND), {"device": "cuda"}, capacity=None)
    g = memory.GIB
    est = dataclasses.replace(
        est, capacity=int(139.8 * g), master_weights=int(9.8 * g), gradients=int(9.7 * g),
        optimizer=int(19.5 * g), train_weight_copies=int(3.3 * g), engine_weights=int(4.9 * g),
        kv_cache=int(0.9 * g), activation_bytes_per_token=int(1.19 * memory.MIB) + 1,
        micro_batch_tokens=1000, budget="derived", logits_chunk=int(0.7 * g), colocated=True,
        checkpoint_layers=True, held_bf16_bytes=int(2.2 * g),
    )  # fmt: skip
    want = (
        "memory (estimate, cuda of 139.8 GiB): weights 9.8 + grads 9.7 + AdamW 19.5 + train "
        "copies 3.3 (held bf16 expert copies 2.2) + engine weights 4.9 + KV 0.9 GiB fixed; "
        "training 1.19 MiB/token x 1000-token micro-batches (derived, checkpoint_layers) = "
        "1.2 GiB; logits chunk 0.7 GiB; peak 50.0 GiB"  # 48.1 fixed + 1.16 + 0.7
    )
    assert est.lines() == [want]
    split = dataclasses.replace(
        est, colocated=False, checkpoint_layers=False,
        held_bf16_bytes=0, not_held_bytes=int(2.2 * g),
    )  # fmt: skip
    line = split.lines()[0]
    assert "AdamW 19.5 + train copies 3.3 (bf16 expert copies not held: their 2.2 GiB do " in line
    line = dataclasses.replace(split, train_weight_copies=0).lines()[0]
    assert "AdamW 19.5 (bf16 expert copies not held: their 2.2 GiB do not fit; " in line
    assert "rl.hold_bf16_weights auto) + engine weights 4.9" in line
    assert "GiB fixed (split: the larger of train and rollout ranks); training" in line
    assert "micro-batches (derived) =" in line
