"""The training pass in micro-batches (mxrl/rl/micro_batch.py): how sequences are cut, how
every train rank gets as many forwards, how the loss stats add up, and that the update of a
step cut in many micro-batches is the update of one (the loss normalised by the whole batch)."""

from __future__ import annotations

import gc

import pytest
import torch

from mxrl.rl import micro_batch
from mxrl.rl.grpo import policy_loss
from mxrl.rl.micro_batch import MicroBatch, combine, split

from .loop_helpers import tiny_trainer


class FakeRanks:
    """`size` train ranks seen from one of them: the others' tensors are given."""

    def __init__(self, size=1, others_max=None, others_sum=None):
        self.size, self.others_max, self.others_sum = size, others_max, others_sum

    def max(self, t):
        return t if self.others_max is None else torch.maximum(t, self.others_max.to(t.dtype))

    def sum(self, t):
        return t if self.others_sum is None else t + self.others_sum


def test_split_cuts_longest_first_by_padded_tokens():
    # padded tokens of a run: its count x its longest; rows taken longest first (7, 5, 3, 2).
    # budget 10: 7 alone (+5: 2 x 7 = 14); 5, 3 (2 x 5 = 10; +2: 15); 2 alone. Each run's rows in
    # request order, the runs longest first
    assert split([3, 5, 2, 7], 10) == [(3,), (0, 1), (2,)]
    # budget 14: 7, 5 (2 x 7 = 14; +3: 21); 3, 2 (2 x 3 = 6)
    assert split([3, 5, 2, 7], 14) == [(1, 3), (0, 2)]
    assert split([3, 5, 2, 7], None) == [(0, 1, 2, 3)]
    assert split([12, 1], 10) == [(0,), (1,)]  # longer than the budget: a run of its own
    assert split([4, 4, 4], 8) == [(0, 1), (2,)]  # equal lengths: request order
    assert split([], 10) == []


def test_like_lengths_together_pad_less_than_request_order():
    # in request order [10, 1] [10, 1] would pad to 2 x 10 + 2 x 10 = 40 tokens; longest first
    # the two 10s share a forward (20) and the two 1s another (2)
    assert split([10, 1, 10, 1], 20) == [(0, 2), (1, 3)]
    assert split([1, 10, 1, 10, 1], 20) == [(1, 3), (0, 2, 4)]


def test_every_rank_runs_as_many_forwards():
    # this rank needs 1 micro-batch, another needs 3: the largest run is halved until 3
    mbs = micro_batch.plan([4, 4, 4, 4], 100, FakeRanks(2, others_max=torch.tensor([3])))
    assert [mb.rows for mb in mbs] == [(0,), (1,), (2, 3)]
    assert all(mb.weight == 1.0 for mb in mbs)
    # fewer sequences than forwards: the first sequence again, its loss weighted 0
    mbs = micro_batch.plan([4, 4], 100, FakeRanks(2, others_max=torch.tensor([4])))
    filler = MicroBatch((0,), 0.0)
    assert mbs == [MicroBatch((0,)), MicroBatch((1,)), filler, filler]
    # one process: the split as it is, no collective
    assert micro_batch.plan([4, 4, 4], 8, FakeRanks()) == [MicroBatch((0, 1)), MicroBatch((2,))]


def test_combine_sums_maxima_and_token_weighted_means():
    a = {"loss/pg": 0.25, "loss/num_tokens": 3.0, "ratio/max": 1.5, "ratio/mean": 1.0}
    b = {"loss/pg": 0.5, "loss/num_tokens": 1.0, "ratio/max": 1.25, "ratio/mean": 2.0}
    got = combine([(a, 3.0), (b, 1.0)], FakeRanks())
    # mean over 4 tokens: (3 x 1.0 + 1 x 2.0) / 4
    assert got == {"loss/pg": 0.75, "loss/num_tokens": 4.0, "ratio/max": 1.5, "ratio/mean": 1.25}
    assert combine([(a, 3.0)], FakeRanks()) == a  # one micro-batch on one process: as it is
    # another rank: sums [loss/num_tokens, loss/pg, ratio/mean x tokens, tokens] and its max
    other = FakeRanks(
        2, torch.tensor([2.0]), torch.tensor([4.0, 1.0, 12.0, 4.0], dtype=torch.float64)
    )
    got = combine([(a, 3.0)], other)
    assert got == {"loss/pg": 1.25, "loss/num_tokens": 7.0, "ratio/max": 2.0, "ratio/mean": 15 / 7}


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_of_micro_batches_adds_up_to_the_whole_batch(aggregation):
    """With the whole batch's count as the denominator (tokens, or sequences with a token),
    the micro-batches' losses and gradients add up to the whole batch's."""
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 0, 7, 3, 6]
    mask = torch.zeros(6, 7)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    logp = (-torch.rand(6, 7, generator=g)).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(6, 7, generator=g)
    adv = torch.randn(6, generator=g)
    whole, _ = policy_loss(logp, old, adv, mask, aggregation=aggregation)
    (grad_whole,) = torch.autograd.grad(whole, logp)
    count = mask.sum() if aggregation == "token-mean" else (mask.sum(-1) > 0).sum()
    total = 0.0
    for rows in ([0, 1], [2, 3, 4], [5]):
        part, _ = policy_loss(
            logp[rows], old[rows], adv[rows], mask[rows], aggregation=aggregation,
            denominator=float(count),
        )  # fmt: skip
        total = total + part
    (grad_parts,) = torch.autograd.grad(total, logp)
    # fp32 sums in another order: a few ulps of the loss (~0.5 here)
    assert float(total.detach()) == pytest.approx(float(whole.detach()), rel=1e-6, abs=1e-7)
    assert torch.allclose(grad_parts, grad_whole, rtol=1e-6, atol=1e-8)


def _one_step_grads(tmp_path, run_id, **overrides):
    """The gradients of step 1 (the optimizer's step replaced by a copy of them) and its
    metrics."""
    trainer = tiny_trainer(tmp_path, run_id, steps=1, **overrides)
    grads = {}

    def capture():
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})

    trainer.opt.step = capture
    metrics = trainer.train_step()
    return grads, metrics


def test_a_step_in_many_micro_batches_is_the_step_in_one(tmp_path):
    """16 sequences of ~15 forward tokens, one micro-batch vs micro-batches of at most 32
    padded tokens (two sequences each, eight forwards): the same gradients within fp32 summation
    order, the same loss and metrics."""
    one, m_one = _one_step_grads(tmp_path, "one")
    many, m_many = _one_step_grads(tmp_path, "many", max_tokens_per_micro_batch=32)
    assert one.keys() == many.keys()
    worst = 0.0
    for name, g in one.items():
        scale = float(g.abs().max()) or 1.0
        worst = max(worst, float((many[name] - g).abs().max()) / scale)
    # each gradient element is a sum over ~100 tokens in another order (and the logits of a
    # row come from a GEMM of another height): measured ~1e-7 of the tensor's largest element
    print(f"worst relative gradient difference {worst:.2e}")
    assert worst < 1e-5, worst
    for key in ("reward/mean", "response_len/mean"):  # the same rollouts
        assert m_many[key] == m_one[key]
    # loss/pg is ~1e-8 on-policy (every ratio 1, the advantages of a group sum to 0): a sum of
    # terms of ~1 / 100 that cancels, so its rounding, ~1e-8, is the bound
    assert m_many["loss/pg"] == pytest.approx(m_one["loss/pg"], abs=1e-7)
    # a row's logprobs depend in their last bits on the batch it runs in (its padding, the
    # GEMMs' height): a few fp32 ulps of a logprob of ~-3 (one ulp 2.4e-7) in each mean
    for key in ("mismatch/k1", "mismatch/k3"):
        assert m_many[key] == pytest.approx(m_one[key], abs=1e-6), key
    assert m_many["loss/clip_frac"] == m_one["loss/clip_frac"]
    assert m_many["grad/norm"] == pytest.approx(m_one["grad/norm"], rel=1e-5)
    # the forwards as the metrics report them: one, then eight of two sequences each, which pad
    # less than one forward of all sixteen (every sequence padded to the longest of them)
    assert (m_one["train/micro_batches"], m_many["train/micro_batches"]) == (1.0, 8.0)
    assert 1.0 <= m_many["train/padded_tokens_ratio"] < m_one["train/padded_tokens_ratio"]


def test_a_resumed_run_keeps_the_micro_batches_it_derived(tmp_path):
    """A budget derived from memory (rl.max_tokens_per_micro_batch 0) is saved with the
    checkpoint: a resume handed another one (the memory free then differs) continues with the
    run's, so it stays bitwise the uninterrupted run."""
    from mxrl.rl.resume import CHECKPOINT_DIR

    from .loop_helpers import numerics

    full = tiny_trainer(tmp_path, "full", micro_batch_tokens=32, steps=2, checkpoint_every=1)
    full.run()
    ckpt = full.record.path / CHECKPOINT_DIR / "step_000001.pt"
    resumed = tiny_trainer(tmp_path, "resumed", micro_batch_tokens=None, steps=2)
    resumed.load_checkpoint(ckpt)
    assert resumed.micro_batch_tokens == 32
    resumed.run()
    assert numerics(resumed.record.metrics()) == numerics(full.record.metrics())[1:]


@pytest.mark.gpu
def test_a_step_whose_batch_logits_exceed_the_memory_cap_runs_on_cuda(tmp_path):
    """Under a 6 GiB cap on an H200: 128 sequences of ~140 tokens at a 65,536-token vocabulary,
    whose fp32 logits alone are ~4.4 GiB: the pass before issue 27 held several such tensors
    at once (bf16 logits, their fp32 copy, the log-softmax, then their gradients), and even
    without autograd it needs more than the cap (measured below). Chunked logprobs and
    4096-token micro-batches keep the whole step inside the cap."""
    from mxrl.app.task import ArithmeticTask
    from mxrl.arch import builtin_config
    from mxrl.models import build_model
    from mxrl.rl.trainer import GRPOTrainer
    from mxrl.runs import RunRecord

    from .loop_helpers import ParitySource, tiny_config

    cap, vocab = 6 << 30, 65536
    cfg = tiny_config(recipe="bf16", device="cuda", prompts_per_step=16, samples_per_prompt=8,
                      max_new_tokens=128, steps=1, max_tokens_per_micro_batch=4096)  # fmt: skip
    model = build_model({**builtin_config("tiny-moe"), "vocab_size": vocab}, seed=0, device="cuda")
    # the cap on top of what the process holds already (earlier tests' caches and graph pools)
    gc.collect()
    torch.cuda.empty_cache()
    held, total = torch.cuda.memory_reserved(), torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((held + cap) / total)
    try:
        record = RunRecord.create(tmp_path, "capped", config=cfg)
        source = ParitySource(ArithmeticTask(seed=0))
        trainer = GRPOTrainer(cfg, model, source, record, kv_cache_bytes=256 << 20)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        metrics = trainer.train_step()
        step_peak = torch.cuda.max_memory_allocated() - base
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    # the old pass, measured without the cap (an OOM under it depends on what earlier tests left
    # in the allocator): the batch's logits, in fp32, log-softmaxed, without autograd even
    ids = torch.randint(vocab, (128, 140), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        torch.log_softmax(trainer.model(ids).float(), -1)
    old_peak = torch.cuda.max_memory_allocated() - base
    assert step_peak < cap < old_peak, (step_peak / 2**30, old_peak / 2**30)
    tokens = 128 * metrics["response_len/mean"]  # the completions alone
    assert tokens * vocab * 4 > cap / 2  # their fp32 logits alone: over half the cap
    assert metrics["memory/train_peak_gib"] < (held + cap) / (1 << 30)
    assert torch.isfinite(torch.tensor(metrics["loss/pg"])) and metrics["grad/norm"] > 0


def test_the_trainer_holds_bf16_expert_copies_as_configured(tmp_path):
    """rl.hold_bf16_weights reaches every experts module of a one-process trainer (the CPU
    reference's loop reads no copy; the grouped GEMMs' is tests/nn/test_hold_bf16.py)."""
    from mxrl.nn import GroupedExperts

    for hold in (True, False):
        trainer = tiny_trainer(tmp_path, f"hold-{hold}", hold_bf16_weights=hold)
        experts = [m for m in trainer.model.modules() if isinstance(m, GroupedExperts)]
        assert experts and all(m.hold_bf16 is hold for m in experts)
    # auto: the caller's memory estimate decides (held without one)
    for decided, want in ((None, True), (True, True), (False, False)):
        trainer = tiny_trainer(
            tmp_path, f"auto-{decided}", hold_bf16_weights="auto", decided=decided
        )
        experts = [m for m in trainer.model.modules() if isinstance(m, GroupedExperts)]
        assert experts and all(m.hold_bf16 is want for m in experts), decided
