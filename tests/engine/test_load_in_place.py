"""Engine.load_weights copies into the buffers the engine already holds: every tensor the
forward reads keeps its storage across a reload (captured CUDA graphs stay valid), the engine
then computes what an engine built on the new weights computes, and the graphs are dropped only
when new buffers were installed."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from mxrl.engine import Engine
from mxrl.formats import QTensor
from mxrl.sync import InProcessTransport
from mxrl.weights import export
from tests.engine.test_engine import tiny
from tests.sync.helpers import engine_logits, hashes

PRESETS = ("bf16", "mxfp8", "nvfp4-dequantized", "fp8-block")


def _tensors_in(obj, depth: int = 0):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, QTensor):
        yield from obj.tensors().values()
    elif depth > 4 or isinstance(obj, (torch.nn.Module, str, bytes, type)):
        return
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, f.name), depth + 1)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, depth + 1)


def forward_tensors(engine: Engine) -> dict[str, tuple[int, tuple[int, ...]]]:
    """(data_ptr, shape) of every tensor held by the engine's modules and weights."""
    out = {}
    for prefix, module in engine.net.named_modules():
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers"):
                items = [(k, t) for k, t in value.items() if t is not None]
            elif key.startswith("_"):
                continue
            else:
                items = [(f"{key}.{i}", t) for i, t in enumerate(_tensors_in(value))]
            for k, t in items:
                out[f"{prefix}.{k}"] = (t.data_ptr(), tuple(t.shape))
    for name, value in engine.weights.items():
        for i, t in enumerate(_tensors_in(value)):
            out[f"weights:{name}.{i}"] = (t.data_ptr(), tuple(t.shape))
    return out


def forward_bytes(engine: Engine) -> str:
    """sha256 over the bytes of every tensor `forward_tensors` lists (the held values and every
    operand derived from them), in a fixed order."""
    h = hashlib.sha256()
    for prefix, module in engine.net.named_modules():
        for key, value in sorted(vars(module).items()):
            if key in ("_parameters", "_buffers"):
                tensors = [t for _, t in sorted(value.items()) if t is not None]
            elif key.startswith("_"):
                continue
            else:
                tensors = list(_tensors_in(value))
            for t in tensors:
                h.update(f"{prefix}.{key}".encode())
                h.update(_bytes(t))
    for name in sorted(engine.weights):
        for t in _tensors_in(engine.weights[name]):
            h.update(name.encode())
            h.update(_bytes(t))
    return h.hexdigest()


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _engine(preset, device, compute_dtype, monkeypatch, calls):
    def counting(self):
        calls.append(self.weights_version)

    monkeypatch.setattr(Engine, "_invalidate_graphs", counting)
    model = tiny(preset, seed=0).to(device)
    return Engine(model, preset, device=device, compute_dtype=compute_dtype)


def reload_in_place(preset, device, compute_dtype, monkeypatch):
    calls: list[int] = []
    engine = _engine(preset, device, compute_dtype, monkeypatch, calls)
    assert calls == [0]  # the first load installs the buffers
    before = forward_tensors(engine)
    assert len(before) > len(engine.plan)
    logits = engine_logits(engine)
    trainer = tiny(preset, seed=1).to(device)
    report = InProcessTransport(engine).send(export(trainer, engine.plan, step=1))
    assert report.version == 2
    assert forward_tensors(engine) == before  # same storage for every tensor the forward reads
    assert calls == [0]  # nothing new installed: the graphs stay
    fresh = Engine(trainer, preset, device=device, compute_dtype=compute_dtype)
    assert hashes(engine.records()) == hashes(fresh.records())
    after = engine_logits(engine)
    assert not torch.equal(after, logits)
    assert torch.equal(after, engine_logits(fresh))


@pytest.mark.parametrize("preset", PRESETS)
def test_reload_keeps_every_buffer_and_equals_a_fresh_engine(preset, monkeypatch):
    reload_in_place(preset, "cpu", torch.float32, monkeypatch)


def test_reload_in_place_when_the_weight_is_its_own_gemm_operand(monkeypatch):
    """bf16 compute: a bf16 weight is both the held value and the GEMM operand (one storage)."""
    reload_in_place("bf16", "cpu", torch.bfloat16, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_reload_in_place_on_cuda(preset, compute_dtype, monkeypatch):
    reload_in_place(preset, "cuda", compute_dtype, monkeypatch)


def test_a_changed_layout_installs_new_buffers_and_drops_the_graphs(monkeypatch):
    """A record whose layout differs from the held one (here: the held value replaced by one of
    another shape behind the engine's back) is installed, not copied, and the graphs go."""
    calls: list[int] = []
    engine = _engine("mxfp8", "cpu", torch.float32, monkeypatch, calls)
    name = "model.layers.0.self_attn.q_proj.weight"
    held = engine.weights[name]
    engine.weights[name] = QTensor(held.qdata[:32], held.scale[:32], held.fmt, (32, held.shape[1]))
    InProcessTransport(engine).send(export(tiny("mxfp8", seed=1), engine.plan, step=1))
    assert calls == [0, 1]
    assert engine.weights[name].shape == held.shape


def test_a_reload_forgets_the_cached_prefixes():
    """A prompt's blocks cached under the old weights are not reused after a load: the same
    prompt then gets what an engine built on the new weights gives (the cached keys and values
    would give the old weights' attention)."""
    from mxrl.engine import SamplingParams
    from tests.engine.test_scheduler import LONG

    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    engine = Engine(tiny("bf16", seed=0), "bf16")
    engine.generate([LONG], greedy)  # caches LONG's two full blocks
    trainer = tiny("bf16", seed=1)
    InProcessTransport(engine).send(export(trainer, engine.plan, step=1))
    got = engine.generate([LONG], greedy)[0]
    want = Engine(trainer, "bf16").generate([LONG], greedy)[0]
    assert got.tokens == want.tokens
    assert torch.equal(got.logprobs, want.logprobs)
    assert torch.equal(got.routed_experts, want.routed_experts)


REFUSED = ["swap_nvfp4_experts", "truncated_scale_fp8_block", "column_wise_mxfp8",
           "nan_global_scale", "global_scale_dtype"]  # fmt: skip


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_refused_load_writes_nothing_the_forward_reads(device):
    """load_weights itself (no transport): forged records (tests/sync/attacks.py) and a stale
    step are refused before any write, so every tensor the forward reads, derived operands
    included, keeps its storage and its bytes, and the hashes, version and step stay."""
    from tests.sync.attacks import ATTACK_IDS, ATTACKS, engine_state
    from tests.sync.helpers import MIXED
    from tests.sync.helpers import tiny as sync_tiny

    engine = Engine(sync_tiny(seed=0).to(device), MIXED, device=device)
    plan_hash = engine.plan.hash()
    honest = list(export(sync_tiny(seed=1).to(device), engine.plan, bucket_bytes=30_000, step=1))
    engine.load_weights([r for b in honest for r in b.records], plan_hash, step=4)
    held = engine_state(engine), forward_tensors(engine), forward_bytes(engine)
    for attack in REFUSED:
        _, forge, name, match = ATTACKS[ATTACK_IDS.index(attack)]
        records = [r for b in forge(honest) for r in b.records]
        with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*" + match):
            engine.load_weights(records, plan_hash, step=5)
        assert (engine_state(engine), forward_tensors(engine), forward_bytes(engine)) == held
    records = [r for b in honest for r in b.records]
    with pytest.raises(ValueError, match="step 3 refused: the engine holds the weights of step 4"):
        engine.load_weights(records, plan_hash, step=3)
    assert (engine_state(engine), forward_tensors(engine), forward_bytes(engine)) == held
    assert engine.load_weights(records, plan_hash, step=5) == engine.weights_version == 3
