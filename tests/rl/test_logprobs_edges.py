"""Edge cases of mxrl/rl/logprobs.py that its mutation run (docs/mutation/rl.logprobs.md) found
untested: the chunk size at a vocabulary past the byte budget, which chunked passes recompute
their logits in the backward, more tokens than the hidden size, token_logprobs' defaults, a
temperature above 1, an empty sequence, and (on CUDA) that every input is made on the model's
device. The expectations are the bigram model's hand values (tests/rl/test_logprobs.py)."""

from __future__ import annotations

import math

import pytest
import torch

from mxrl.engine import SamplingParams
from mxrl.rl import completion_logprobs, logprobs
from mxrl.rl.logprobs import sequence_logprobs, token_logprobs

from .test_logprobs import COMPLETIONS, PLAIN, PROMPTS, WEIGHTS, Bigram, _log, _rows


def test_the_chunk_is_at_least_one_token():
    """LOGITS_CHUNK_BYTES (2^28) of fp32 logits: 2^28 / (4 x 2^25) = 2 tokens at a 2^25
    vocabulary, 1 at 2^26, and still 1 (not 0) past it, where one token's logits alone exceed
    the budget."""
    assert logprobs.LOGITS_CHUNK_BYTES == 1 << 28
    assert logprobs.logits_chunk_tokens(1 << 25) == 2
    assert logprobs.logits_chunk_tokens(1 << 26) == 1
    assert logprobs.logits_chunk_tokens((1 << 26) + 1) == 1
    assert logprobs.logits_chunk_tokens(1 << 30) == 1


# 0 -> 1 -> 3 -> 2 -> 3 -> 0: five completion tokens, more than the bigram's 4 hidden columns
LONG_PROMPT, LONG = [0], [1, 3, 2, 3, 0]
LONG_WANT = [_log(2, 8), _log(1, 4), _log(2, 8), _log(1, 8), _log(1, 8)]


def _counting_checkpoint(monkeypatch):
    calls = []
    real = logprobs.checkpoint

    def counted(*args, **kwargs):
        calls.append(args[2].shape[0])  # the chunk's tokens (its hidden states' rows)
        return real(*args, **kwargs)

    monkeypatch.setattr(logprobs, "checkpoint", counted)
    return calls


def test_chunks_are_recomputed_only_under_autograd_and_only_when_there_are_several(monkeypatch):
    """Chunks of 2 tokens (the bigram's vocabulary is 4): 5 tokens are 3 chunks. Each is
    checkpointed when a gradient will be taken (grad mode on and the hidden states requiring
    it); not under no_grad, not for hidden states without grad, not for a single chunk."""
    monkeypatch.setattr(logprobs, "LOGITS_CHUNK_BYTES", 4 * 4 * 2)
    assert logprobs.logits_chunk_tokens(4) == 2
    calls = _counting_checkpoint(monkeypatch)

    trained = Bigram()
    trained.table.requires_grad_(True)
    out = sequence_logprobs(trained, [LONG_PROMPT], [LONG])
    assert _rows(out.detach()) == [LONG_WANT]  # every chunk, hidden size 4 < 5 tokens
    assert calls == [2, 2, 1]
    # the gradient flows through the recomputed chunks: d/dtable of log p(1 | 0) = log 2 - log 8
    # is 1 - 2/8 at [0, 1] (the table is log-weights, scaled by 2 then halved)
    (grad,) = torch.autograd.grad(out[0, 0], trained.table)
    assert float(grad[0, 1]) == pytest.approx(1 - 2 / 8, abs=1e-6)
    assert float(grad[0, 0]) == pytest.approx(-4 / 8, abs=1e-6)

    calls.clear()
    with torch.no_grad():
        assert _rows(sequence_logprobs(trained, [LONG_PROMPT], [LONG])) == [LONG_WANT]
    assert calls == []  # nothing to recompute for
    assert _rows(sequence_logprobs(Bigram(), [LONG_PROMPT], [LONG])) == [LONG_WANT]
    assert calls == []  # the hidden states need no gradient
    # exactly one chunk's tokens (2): computed as one, under autograd too
    out = sequence_logprobs(trained, [LONG_PROMPT], [LONG[:2]])
    assert _rows(out.detach()) == [LONG_WANT[:2]]
    assert calls == []
    got = completion_logprobs(trained, [LONG_PROMPT], [LONG], replay_routing=[None])
    assert [[float(x) for x in t.detach()] for t in got] == [LONG_WANT]


def test_unequal_prompts_and_completions_are_refused_before_any_forward():
    """One sequence at a time too: the lengths are checked first, not after the forwards of the
    pairs that zip would still make."""
    for routing in (None, [None, None]):
        model = Bigram()
        with pytest.raises(ValueError):
            completion_logprobs(model, [[1], [2]], [[3]], replay_routing=routing)
        assert model.calls == []


def test_token_logprobs_defaults_are_the_plain_distribution():
    """No temperature, top-k or top-p given: the model's own distribution, row 0 of WEIGHTS
    (4 2 1 1 of 8) for every token."""
    model = Bigram()
    hidden = 2 * model.table[torch.tensor([0, 0, 0, 0])]  # the bigram's hidden states after 0
    got = token_logprobs(model, hidden, torch.tensor([0, 1, 2, 3]))
    assert [float(x) for x in got] == [_log(4, 8), _log(2, 8), _log(1, 8), _log(1, 8)]


def test_a_temperature_above_one_flattens():
    """Temperature 2: the weights' square roots. Sequence 0 is 0 -> 1 -> 3 -> 2 (row 0: 2 r2 1
    1, row 1 uniform, row 3: 1 1 r2 2), sequence 1 is 3 -> 0."""
    r2 = math.sqrt(2)
    want = [
        [_log(r2, 4 + r2), _log(1, 4), _log(r2, 4 + r2)],
        [_log(1, 4 + r2)],
    ]
    assert [[float(x) for x in row] for row in WEIGHTS] == [[4, 2, 1, 1], [1] * 4, [1, 2, 4, 1],
                                                             [1, 1, 2, 4]]  # fmt: skip
    out = sequence_logprobs(Bigram(), PROMPTS, COMPLETIONS, temperature=2.0)
    assert _rows(out) == [want[0], [*want[1], 0.0, 0.0]]
    got = completion_logprobs(Bigram(), PROMPTS, COMPLETIONS, SamplingParams(temperature=2.0))
    assert [[float(x) for x in t] for t in got] == want


def test_an_empty_sequence_has_no_logprobs_and_leaves_its_batch_alone():
    """No prompt and no completion: an empty row (batched) or an empty tensor (one sequence at
    a time), the other sequences' values as ever."""
    prompts, completions = [[], *PROMPTS], [[], *COMPLETIONS]
    out = sequence_logprobs(Bigram(), prompts, completions)
    assert _rows(out) == [[0.0, 0.0, 0.0], PLAIN[0], [*PLAIN[1], 0.0, 0.0]]
    got = completion_logprobs(Bigram(), prompts, completions, replay_routing=[None, None, None])
    assert [[float(x) for x in t] for t in got] == [[], *PLAIN]
    assert [t.dtype for t in got] == [torch.float32] * 3


@pytest.mark.gpu
def test_the_inputs_are_made_on_the_model_device():
    """A model on CUDA: the ids, the mask, the routing, the targets and the top-k / top-p
    tensors are all made on its device (a CPU tensor beside a CUDA one fails, or moves every
    step's inputs one by one)."""
    model = Bigram().cuda()
    out = sequence_logprobs(model, PROMPTS, COMPLETIONS, top_k=2)
    assert out.device.type == "cuda"
    ((ids, call),) = model.calls
    assert ids.device.type == "cuda" and call["attention_mask"].device.type == "cuda"
    assert _rows(sequence_logprobs(Bigram().cuda(), PROMPTS, COMPLETIONS, top_p=0.6).cpu()) == [
        [_log(2, 6), _log(1, 4), _log(2, 6)],
        [_log(1, 7), 0.0, 0.0],
    ]
    routing = [torch.tensor([[[1], [0], [2]], [[3], [3], [1]]]), None]
    model = Bigram().cuda()
    params = SamplingParams(top_k=2)
    got = completion_logprobs(model, PROMPTS, COMPLETIONS, params, replay_routing=routing)
    assert [[float(x) for x in t] for t in got] == [
        [_log(2, 6), _log(1, 4), _log(2, 6)],
        [_log(1, 7)],
    ]
    (ids0, kw0), (ids1, _) = model.calls
    assert ids0.device.type == ids1.device.type == "cuda"
    assert all(r.device.type == "cuda" for r in kw0["replay_routing"])


# LONG's hand values per setting (tests/rl/test_logprobs.py's rows; row 2 is 1 2 4 1):
# temperature 0.5 squares the weights (row 2: 1 4 16 1 of 22); top-k 2 and top-p 0.6 keep the
# two largest of rows 0, 2 and 3 (row 1 keeps all four) plus the sampled token
CHUNKED = [
    (dict(temperature=0.5), [_log(4, 22), _log(1, 4), _log(4, 22), _log(1, 22), _log(1, 22)]),
    (dict(top_k=2), [_log(2, 6), _log(1, 4), _log(2, 6), _log(1, 7), _log(1, 7)]),
    (dict(top_p=0.6), [_log(2, 6), _log(1, 4), _log(2, 6), _log(1, 7), _log(1, 7)]),
]


@pytest.mark.parametrize(("kwargs", "want"), CHUNKED)
@pytest.mark.parametrize("grad", [True, False])
def test_every_chunk_takes_the_sampling_settings(monkeypatch, kwargs, want, grad):
    """Chunks of 2 tokens, recomputed (grad) or not: each chunk applies temperature, top-k and
    top-p."""
    monkeypatch.setattr(logprobs, "LOGITS_CHUNK_BYTES", 4 * 4 * 2)
    model = Bigram()
    model.table.requires_grad_(grad)
    out = sequence_logprobs(model, [LONG_PROMPT], [LONG], **kwargs)
    assert _rows(out.detach()) == [want]
