"""What a load remembers between syncs (`WeightLoading._target`: each name's module, looked up
once per net) belongs to one engine and one net: a sync into one engine writes nothing of
another's, and an engine given another net looks its names up there."""

from __future__ import annotations

import pytest
import torch

from mxrl.engine import Engine
from mxrl.sync import InProcessTransport
from mxrl.weights import export
from tests.sync.helpers import engine_logits, tiny


@pytest.mark.parametrize("preset", ["bf16", "mxfp8"])
def test_a_sync_into_one_engine_leaves_another_built_on_the_same_model_as_it_was(preset):
    model = tiny(seed=0)
    first = Engine(model, preset, device="cpu")
    second = Engine(model, preset, device="cpu")
    InProcessTransport(first).send(export(model, first.plan, step=1))
    InProcessTransport(second).send(export(model, second.plan, step=1))
    before = engine_logits(second)

    trained = tiny(seed=1)  # other weights, the same names and plan
    InProcessTransport(first).send(export(trained, first.plan, step=2))
    torch.testing.assert_close(engine_logits(second), before, rtol=0, atol=0)
    assert first.hashes != second.hashes
    fresh = Engine(trained, preset, device="cpu")
    torch.testing.assert_close(engine_logits(first), engine_logits(fresh), rtol=0, atol=0)
    for name in first.plan:
        owner = name.rpartition(".")[0]
        assert first._target(name)[0] is first.net.get_submodule(owner)
        assert second._target(name)[0] is second.net.get_submodule(owner)
        assert first._target(name)[0] is not second._target(name)[0]


def test_an_engine_given_another_net_looks_its_names_up_there():
    model = tiny(seed=0)
    engine = Engine(model, "mxfp8", device="cpu")
    name = next(iter(engine.plan))
    old = engine._target(name)[0]
    engine.net = engine._build()  # the modules of another net
    owner = name.rpartition(".")[0]
    assert engine._target(name)[0] is engine.net.get_submodule(owner) is not old


def test_a_value_is_staged_where_to_would_put_it():
    """`_stage` moves a value only where `.to(engine.device)` would: a CUDA device without
    an index is the current one (`_with_index`), any other device is itself."""
    from mxrl.engine.loading import _with_index

    assert _with_index(torch.device("cpu")) == torch.device("cpu")
    assert _with_index(torch.device("cuda", 1)) == torch.device("cuda", 1)
    model = tiny(seed=0)
    engine = Engine(model, "mxfp8", device="cpu")
    exp = export(model, engine.plan, step=1)
    records = list(exp.records())
    q = next(r for r in records if r.name.endswith("q_proj.weight"))
    staged, _ = engine._stage(q.name, q.value)
    assert staged is q.value  # not even a new QTensor around the same fields (its .to's)
    assert staged.qdata is q.value.qdata and staged.scale is q.value.scale


@pytest.mark.gpu
def test_a_cuda_device_without_an_index_is_the_current_one():
    from mxrl.engine.loading import _with_index

    current = torch.device("cuda", torch.cuda.current_device())
    assert _with_index(torch.device("cuda")) == current
    assert torch.zeros(1, device=current).to(torch.device("cuda")).device == current


def test_a_names_module_is_looked_up_once_per_net(monkeypatch):
    """`_target` asks the net for a name's module once; the next loads reuse it, until the
    engine holds another net."""
    model = tiny(seed=0)
    engine = Engine(model, "mxfp8", device="cpu")
    name = next(iter(engine.plan))
    engine.net = engine._build()  # a net none of whose names was looked up yet
    calls = []
    real = engine.net.get_submodule
    monkeypatch.setattr(
        engine.net, "get_submodule", lambda owner: calls.append(owner) or real(owner)
    )
    first = engine._target(name)
    assert engine._target(name) == first and len(calls) == 1
    other = next(n for n in engine.plan if n != name)
    engine._target(other)
    engine._target(name)
    assert calls == [name.rpartition(".")[0], other.rpartition(".")[0]]


def test_the_held_value_is_compared_with_a_received_one_on_any_device():
    """Before staging, a received value is compared with the held one by shapes and dtypes
    alone: records on another device (the meta device stands in for one) still load in place."""
    from mxrl.engine.loading import _same_value_layout

    cpu, meta = torch.zeros(2), torch.zeros(2, device="meta")
    assert _same_value_layout((cpu, "what the module holds"), meta)
    assert not _same_value_layout(None, cpu)  # nothing held yet: a first load installs
    assert not _same_value_layout((cpu, None), torch.zeros(3))
    assert not _same_value_layout((cpu, None), torch.zeros(2, dtype=torch.bfloat16))
