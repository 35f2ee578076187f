"""The trainer's logprobs of sampled tokens (mxrl/rl/logprobs.py) on a bigram model whose
next-token distribution is written out by hand: every expected value below is the log of a
fraction of small integer weights, worked out from the module's docstring (logits /
temperature, top-k then top-p, the sampled token never dropped, renormalised)."""

from __future__ import annotations

import math

import pytest
import torch

from mxrl.arch.config import ModelConfig
from mxrl.engine import SamplingParams
from mxrl.rl import completion_logprobs
from mxrl.rl.logprobs import sequence_logprobs

# Row v: the weights of the next token after token v (logits = their logs).
WEIGHTS = [
    [4, 2, 1, 1],
    [1, 1, 1, 1],
    [1, 2, 4, 1],
    [1, 1, 2, 4],
]


class _Limits:
    """Only what the logprob path reads of a model config: max_position_embeddings."""

    check_positions = ModelConfig.check_positions

    def __init__(self, max_positions):
        self.max_positions = max_positions
        self.vocab_size = len(WEIGHTS)


class Bigram(torch.nn.Module):
    """logits[b, s] = log WEIGHTS[ids[b, s]]; records every call's inputs. Its "hidden state"
    is twice the row of logits and its lm_head halves it (exact in binary floating point): the
    path must ask for the hidden states, then the logits of a chunk of them; logits taken for
    hidden states would be those at temperature 2."""

    def __init__(self, max_positions=8):
        super().__init__()
        self.table = torch.nn.Parameter(
            torch.tensor(WEIGHTS, dtype=torch.float64).log().float(), requires_grad=False
        )
        self.config = _Limits(max_positions)
        self.calls = []

    def forward(self, ids, return_hidden=False, **kwargs):
        self.calls.append((ids.clone(), kwargs))
        return 2 * self.table[ids] if return_hidden else self.table[ids]

    def logits(self, hidden):
        return hidden / 2


# prompts and completions of different lengths: the batch is right-padded
PROMPTS = [[0], [3]]
COMPLETIONS = [[1, 3, 2], [0]]


def _log(num, den):
    return pytest.approx(math.log(num / den), abs=1e-6)


# Expected logprobs of COMPLETIONS, per setting. Sequence 0 is 0 -> 1 -> 3 -> 2, sequence 1 is
# 3 -> 0.
PLAIN = [[_log(2, 8), _log(1, 4), _log(2, 8)], [_log(1, 8)]]
# temperature 0.5 squares the weights: row 0 -> 16 4 1 1, row 1 uniform, row 3 -> 1 1 4 16
HALF = [[_log(4, 22), _log(1, 4), _log(4, 22)], [_log(1, 22)]]
# top-k 2 keeps the two largest (ties at the boundary kept: row 1 keeps all four) and the
# sampled token: row 0 keeps 4 2; row 3 keeps 2 4, and sequence 1's sampled 0 joins them
TOP_K2 = [[_log(2, 6), _log(1, 4), _log(2, 6)], [_log(1, 7)]]
# top-p 0.6: row 0's sorted mass before each token is 0 .5 .75 .875: 4 2 kept; row 1's is
# 0 .25 .5 .75: tokens 0 1 2 kept, and the sampled 3 too (all four); row 3 as row 0 (4 2 kept,
# the sampled 0 added in sequence 1)
TOP_P06 = TOP_K2
# temperature 0.5 and top-k 2: row 0 keeps 16 4; row 3 keeps 4 16 (+ the sampled 1 in seq 1)
HALF_TOP_K2 = [[_log(4, 20), _log(1, 4), _log(4, 20)], [_log(1, 21)]]

SETTINGS = [
    (dict(), PLAIN),
    (dict(temperature=0.0), PLAIN),  # temperature 0 (greedy) means unscaled logits
    (dict(temperature=1.0), PLAIN),
    (dict(temperature=0.5), HALF),
    (dict(top_k=2), TOP_K2),
    (dict(top_k=4), PLAIN),  # k = V: off
    (dict(top_p=0.6), TOP_P06),
    (dict(top_p=1.0), PLAIN),
    (dict(temperature=0.5, top_k=2), HALF_TOP_K2),
]


def _rows(t):
    return [[float(x) for x in row] for row in t]


@pytest.mark.parametrize(("kwargs", "want"), SETTINGS)
def test_sequence_logprobs_are_the_sampled_from_distribution(kwargs, want):
    model = Bigram()
    out = sequence_logprobs(model, PROMPTS, COMPLETIONS, **kwargs)
    assert out.dtype == torch.float32 and out.shape == (2, 3)
    assert _rows(out) == [want[0], [*want[1], 0.0, 0.0]]  # 0 past each completion
    # one right-padded forward over prompt + completion minus its last token, the padding masked
    ((ids, call),) = model.calls
    assert ids.tolist() == [[0, 1, 3], [3, 0, 0]]
    mask = call["attention_mask"]
    assert mask.dtype == torch.int64 and mask.tolist() == [[1, 1, 1], [1, 1, 0]]


@pytest.mark.parametrize(("kwargs", "want"), SETTINGS)
def test_completion_logprobs_batched_and_per_sequence_agree_with_the_hand_values(kwargs, want):
    batched = completion_logprobs(Bigram(), PROMPTS, COMPLETIONS, SamplingParams(**kwargs))
    assert [t.shape for t in batched] == [(3,), (1,)]
    assert [t.dtype for t in batched] == [torch.float32, torch.float32]
    assert [[float(x) for x in t] for t in batched] == want
    # replay_routing: one forward per sequence, its routing passed with a batch dim of 1
    model = Bigram()
    routing = [torch.tensor([[[1], [0], [2]], [[3], [3], [1]]]), None]  # [num_moe, len - 1, k]
    single = completion_logprobs(
        model, PROMPTS, COMPLETIONS, SamplingParams(**kwargs), replay_routing=routing
    )
    assert [[float(x) for x in t] for t in single] == want
    assert [t.dtype for t in single] == [torch.float32, torch.float32]
    (ids0, kw0), (ids1, kw1) = model.calls
    assert ids0.tolist() == [[0, 1, 3]] and ids1.tolist() == [[3]]
    assert list(kw0) == ["replay_routing"] and kw1 == {}
    assert [r.tolist() for r in kw0["replay_routing"]] == [[[[1], [0], [2]]], [[[3], [3], [1]]]]


def test_an_empty_completion_has_no_logprobs():
    prompts, completions = [[0, 1], [2]], [[], [3]]
    out = sequence_logprobs(Bigram(), prompts, completions)
    assert _rows(out) == [[0.0], [_log(1, 8)]]
    for routing in (None, [None, None]):
        got = completion_logprobs(Bigram(), prompts, completions, replay_routing=routing)
        assert [t.shape for t in got] == [(0,), (1,)] and float(got[1][0]) == _log(1, 8)
    assert sequence_logprobs(Bigram(), [[1]], [[]]).shape == (1, 0)


def test_the_position_limit_is_prompt_plus_completion():
    """8 positions: a prompt of 5 and a completion of 3 fit, one more token is refused, for
    every sequence of the batch and on both paths."""
    fits = ([[1], [0] * 5], [[2], [1] * 3])
    assert sequence_logprobs(Bigram(), *fits).shape == (2, 3)
    assert [len(t) for t in completion_logprobs(Bigram(), *fits)] == [1, 3]
    too_long = ([[1], [0] * 5], [[2], [1] * 4])
    msg = r"^sequence 1: the prompt's 5 tokens \+ its completion's length 4 = 9 tokens exceed"
    for fn in (sequence_logprobs, completion_logprobs):
        model = Bigram()
        with pytest.raises(ValueError, match=msg):
            fn(model, *too_long)
        assert model.calls == []  # refused before any forward
    with pytest.raises(ValueError, match=msg):
        completion_logprobs(Bigram(), *too_long, replay_routing=[None, None])
    # unequal numbers of prompts and completions are refused, not truncated
    with pytest.raises(ValueError):
        sequence_logprobs(Bigram(), [[1], [2]], [[3]])


def test_top_p_drops_a_token_whose_mass_before_it_reaches_top_p():
    """The boundary: the kept set is the smallest whose mass reaches top_p, so a token with
    exactly top_p of mass before it is dropped. Row 1 is uniform (masses before each token, in
    float exactly: 0 .25 .5 .75): top_p 0.5 keeps tokens 0 1 and the sampled 3, not 2."""
    out = sequence_logprobs(Bigram(), [[1]], [[3]], top_p=0.5)
    assert _rows(out) == [[_log(1, 3)]]


def _dense_logprobs(model, prompts, completions):
    """What the trainer computed before chunking: the whole batch's [B, S, V] logits, fp32
    log-softmax, the sampled tokens gathered."""
    out = []
    for p, c in zip(prompts, completions, strict=True):
        ids = torch.tensor([[*p, *c]])
        logits = model(ids[:, :-1])[0, len(p) - 1 :].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0])
    return out


def test_chunked_logprobs_are_the_dense_ones_and_never_hold_the_batch_logits(monkeypatch):
    """A MoE model with a vocabulary larger than its hidden size (2048 vs 64), logits in chunks
    of 5 tokens: the logprobs and their gradients are those of the dense computation, and no
    tensor kept for the backward has more than one chunk's rows of logits."""
    from mxrl.arch import builtin_config
    from mxrl.models import build_model
    from mxrl.rl import logprobs

    vocab = 2048
    model = build_model({**builtin_config("tiny-moe"), "vocab_size": vocab}, seed=0)
    g = torch.Generator().manual_seed(0)
    lens = [(3, 6), (5, 1), (2, 9)]  # 16 completion tokens: 4 chunks
    prompts = [torch.randint(vocab, (p,), generator=g).tolist() for p, _ in lens]
    completions = [torch.randint(vocab, (c,), generator=g).tolist() for _, c in lens]
    weights = torch.randn(3, 9, generator=g)

    dense = _dense_logprobs(model, prompts, completions)
    loss = sum((d * weights[i, : len(d)]).sum() for i, d in enumerate(dense))
    want = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)

    monkeypatch.setattr(logprobs, "LOGITS_CHUNK_BYTES", 4 * vocab * 5)
    assert logprobs.logits_chunk_tokens(vocab) == 5
    rows_kept = []

    def pack(t):
        if t.dim() >= 1 and t.shape[-1] == vocab:
            rows_kept.append(t.numel() // vocab)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = sequence_logprobs(model, prompts, completions)
        loss = (got * weights).sum()
    assert sum(rows_kept) <= 5, rows_kept  # all chunks together: one chunk's rows at most
    for i, d in enumerate(dense):
        torch.testing.assert_close(got[i, : len(d)], d, rtol=0, atol=2e-6)
        assert (got[i, len(d) :] == 0).all()
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    for (name, _), a, b in zip(model.named_parameters(), grads, want, strict=True):
        if b is None:
            assert a is None or not a.any(), name
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
