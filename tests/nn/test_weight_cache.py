"""The quantized-weight cache sees every weight change: a version bump, an optimizer step, and a
change its version counter does not show (FSDP2's all-gather into the same buffer) once
`weights_changed` is called."""

from __future__ import annotations

import torch

from mxrl.nn import WeightCache, weights_changed


def _counting_cache():
    cache, builds = WeightCache(), []

    def build():
        builds.append(1)
        return len(builds)

    return cache, builds, build


def test_cache_rebuilds_on_version_bump_step_and_epoch():
    w = torch.nn.Parameter(torch.ones(4, 4))
    cache, _, build = _counting_cache()
    assert cache.get((w,), build) == 1 and cache.get((w,), build) == 1  # cached
    with torch.no_grad():
        w.add_(1)  # an in-place update bumps the version counter
    assert cache.get((w,), build) == 2
    w.data.copy_(torch.zeros(4, 4))  # invisible to the version counter (as FSDP2's all-gather)
    assert cache.get((w,), build) == 2
    weights_changed()
    assert cache.get((w,), build) == 3
    opt = torch.optim.SGD([w], lr=0.1)
    w.grad = torch.ones(4, 4)
    before = w._version
    opt.step()
    w.data.copy_(torch.zeros(4, 4))
    assert w._version >= before
    assert cache.get((w,), build) == 4  # the optimizer's post-step hook moved the epoch
    assert cache.get((w,), build) == 4
