"""The golden run: the metrics of a tiny deterministic GRPO run (tests/rl/loop_helpers.py),
committed in tests/golden/grpo_tiny.json and compared exactly by tests/rl/test_loop.py.

It always runs in a fresh process under `tests.numeric_env.PINNED` (ATen's scalar kernels, MKL's
COMPATIBLE mode, one thread), set before torch is imported, so every x86-64 machine computes the
same numbers; tests/golden/README.md says what was measured.

    python -m tests.rl.golden            # print the pinned run's metrics (JSON)
    python -m tests.rl.golden --write    # rewrite the golden file after a deliberate change
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from tests.numeric_env import PINNED, run_python

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "grpo_tiny.json"


def pinned_metrics() -> list[dict]:
    """The golden run's metrics, computed in a pinned child process."""
    out = run_python(["-m", "tests.rl.golden", "--child"], PINNED)
    if out.returncode != 0:
        raise RuntimeError(f"the pinned golden run failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout)


def _child() -> None:
    unpinned = {k: v for k, v in PINNED.items() if os.environ.get(k) != v}
    if unpinned:
        sys.exit(f"tests.rl.golden --child runs under the pinned environment; unset: {unpinned}")
    import torch

    from tests.rl.loop_helpers import numerics, tiny_trainer

    assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
    torch.set_num_threads(1)
    trainer = tiny_trainer(Path(tempfile.mkdtemp()), "golden")
    trainer.run()
    print(json.dumps(numerics(trainer.record.metrics())))


if __name__ == "__main__":
    if "--child" in sys.argv:
        _child()
    else:
        rows = pinned_metrics()
        if "--write" in sys.argv:
            GOLDEN.write_text(json.dumps(rows, indent=1) + "\n")
            print(f"wrote {GOLDEN}")
        else:
            print(json.dumps(rows, indent=1))
