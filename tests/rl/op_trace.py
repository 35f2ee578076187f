"""Find the op whose result depends on the machine: trace every aten op of the golden run with
the hash of its inputs and outputs, on two machines, and compare (tests/golden/README.md).

    python -m tests.rl.op_trace trace.gz                 # under the pin: write this machine's trace
    python -m tests.rl.op_trace trace.gz --against ref.gz --save culprits.pt

With --against, every op whose inputs hash the same as the reference's op at that position but
whose outputs do not is printed (and the first 12 saved with their inputs and outputs), until the
two runs' op sequences part. Outputs of `empty*` ops are zero-filled so their hashes are
deterministic (what they held is never read by a correct program).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from tests.numeric_env import PINNED, run_python

EMPTY = {"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided"}
MAX_SAVED = 12


def _digest(objs) -> str:
    h = hashlib.sha1()
    for t in objs:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_meta:
            try:
                h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
            except (RuntimeError, TypeError):
                h.update(repr(t.dtype).encode())
        else:
            h.update(repr(t).encode()[:64])
    return h.hexdigest()[:12]


def _clone(x):
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, x)


class OpTrace(TorchDispatchMode):
    def __init__(self, out, reference: list[list[str]] | None) -> None:
        super().__init__()
        self.out, self.reference = out, reference
        self.n, self.parted, self.culprits = 0, False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        watching = self.reference is not None and not self.parted
        inputs = _digest(tree_flatten((args, kwargs))[0])
        snapshot = _clone((args, kwargs)) if watching and len(self.culprits) < MAX_SAVED else None
        result = func(*args, **kwargs)
        if name.split(".")[1] in EMPTY:
            with _disable_current_modes():
                for t in tree_flatten(result)[0]:
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                        t.zero_()
        outputs = _digest(tree_flatten(result)[0])
        self.out.write(f"{self.n}\t{name}\t{inputs}\t{outputs}\n")
        if watching and self.n < len(self.reference) and "profiler" not in name:
            ref = self.reference[self.n]
            if ref[1] != name:
                self.parted = True
                print(f"op {self.n}: the runs part ({ref[1]} here {name})", file=sys.stderr)
            elif ref[2] == inputs and ref[3] != outputs:
                print(f"op {self.n}: {name} same inputs, other outputs", file=sys.stderr)
                if snapshot is not None:
                    self.culprits.append({"op": self.n, "func": name, "inputs": snapshot,
                                          "outputs": _clone(result)})  # fmt: skip
        self.n += 1
        return result


def _child(path: Path, against: Path | None, save: Path | None) -> None:
    from tests.rl.loop_helpers import numerics, tiny_trainer

    reference = None
    if against is not None:
        with gzip.open(against, "rt") as f:
            reference = [line.rstrip("\n").split("\t") for line in f]
    torch.set_num_threads(1)
    with gzip.open(path, "wt") as out, OpTrace(out, reference) as trace:
        trainer = tiny_trainer(Path(tempfile.mkdtemp()), "golden")
        trainer.run()
    if save is not None and trace.culprits:
        torch.save(trace.culprits, save)
    print(json.dumps(numerics(trainer.record.metrics())))
    print(f"{trace.n} ops traced to {path}", file=sys.stderr)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.rl.op_trace")
    parser.add_argument("trace", type=Path)
    parser.add_argument("--against", type=Path)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.trace, args.against, args.save)
        return
    extra = [a for flag in ("against", "save") if getattr(args, flag)
             for a in (f"--{flag}", str(getattr(args, flag).resolve()))]  # fmt: skip
    out = run_python(
        ["-m", "tests.rl.op_trace", str(args.trace.resolve()), *extra, "--child"], PINNED,
        timeout=3600,
    )  # fmt: skip
    sys.stdout.write(out.stdout)
    sys.stderr.write(out.stderr[-4000:])
    sys.exit(out.returncode)


if __name__ == "__main__":
    main(sys.argv[1:])
