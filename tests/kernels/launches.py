"""A stand-in for Triton kernels in launcher tests: each named kernel of a module replaced by a
recorder of its launches, (name, grid, args, kwargs), that runs nothing."""

from __future__ import annotations


def spy_launches(monkeypatch, module, names) -> list:
    launches: list = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((self.name, grid, args, kw))

    for name in names:
        monkeypatch.setattr(module, name, Kernel(name))
    return launches
