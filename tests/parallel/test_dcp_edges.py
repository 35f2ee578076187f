"""The edges of mxrl/parallel/dcp.py in one process: a one-rank gloo group (a FileStore in
tmp_path) for DCP itself, and the module's own torch.distributed calls (its rank, its barriers)
and DCP's entry points recorded through stand-ins that check the group they are given, so that
a rank other than 0 and a collective on the wrong group can be told apart on one rank.

test_train.py's torchrun runs save and resume a real two-rank run (`make test`); mutmut's
per-function test selection cannot see their spawned ranks."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from mxrl.parallel import dcp as ckpt


class Recorded:
    """torch.distributed as mxrl/parallel/dcp.py calls it, for `group`: each barrier logged, any
    call on another group an error, and the rank it reports `rank`."""

    def __init__(self, group, rank: int = 0) -> None:
        self.group, self.rank, self.log = group, rank, []

    def _check(self, group) -> None:
        if group is not self.group:
            raise RuntimeError(f"a call on group {group!r}, not the train group")

    def get_rank(self, group=None) -> int:
        self._check(group)
        return self.rank

    def barrier(self, group=None) -> None:
        self._check(group)
        self.log.append("barrier")
        dist.barrier(group=group)


class RecordedDcp:
    """torch.distributed.checkpoint's save and load, each call's arguments logged."""

    def __init__(self, log: list) -> None:
        self.log = log

    def save(self, state, *, checkpoint_id, process_group):
        self.log.append(("save", Path(checkpoint_id), process_group))
        torch.distributed.checkpoint.save(
            state, checkpoint_id=checkpoint_id, process_group=process_group
        )

    def load(self, state, *, checkpoint_id, process_group=None, no_dist=False):
        self.log.append(("load", Path(checkpoint_id), process_group, no_dist))
        torch.distributed.checkpoint.load(
            state, checkpoint_id=checkpoint_id, process_group=process_group, no_dist=no_dist
        )


@pytest.fixture
def group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.new_group([0])  # a train group that is not the default one
    finally:
        dist.destroy_process_group()


@pytest.fixture
def recorded(group, monkeypatch):
    fake = Recorded(group)
    monkeypatch.setattr(ckpt, "dist", fake)
    monkeypatch.setattr(ckpt, "dcp", RecordedDcp(fake.log))
    return fake


def model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()  # moments to restore
    opt.zero_grad()
    return model, opt


# a Path: only a full unpickler reads it; a tensor: read where map_location puts it
TRAINER = {"step": 20, "run": Path("runs/a"), "mean": torch.tensor([0.25, 0.5])}
RANK = {"numpy": np.random.RandomState(7).get_state(), "torch": torch.tensor([1, 2])}


def test_a_checkpoint_is_written_whole_under_its_step_and_read_back(recorded, tmp_path):
    folder = tmp_path / "run" / "checkpoints"  # its parents too are created
    model, opt = model_and_optimizer(0)
    path = ckpt.save(folder, 20, model, opt, recorded.group, trainer_state=TRAINER, rank_state=RANK)
    assert path == folder / "step_000020" and path.is_dir()
    assert sorted(p.name for p in folder.iterdir()) == ["step_000020"]  # no .tmp left
    names = sorted(p.name for p in path.iterdir())
    assert ".metadata" in names and "trainer.pt" in names and "rng_rank0.pt" in names
    assert recorded.log == [
        "barrier", ("save", folder / "step_000020.tmp", recorded.group), "barrier", "barrier"
    ]  # fmt: skip
    trainer = ckpt.trainer_state(path)
    assert trainer.keys() == TRAINER.keys() and trainer["run"] == Path("runs/a")
    assert trainer["step"] == 20 and torch.equal(trainer["mean"], TRAINER["mean"])

    other, other_opt = model_and_optimizer(1)
    recorded.log.clear()
    state = ckpt.load(path, other, other_opt, recorded.group)
    assert recorded.log == [("load", path, recorded.group, False)]
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), other_opt.state.values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(
            a["exp_avg_sq"], b["exp_avg_sq"]
        )
    assert torch.equal(state["torch"], RANK["torch"])
    assert all(np.array_equal(x, y) for x, y in zip(state["numpy"], RANK["numpy"], strict=True))


def test_a_stale_temporary_and_an_older_copy_of_the_step_are_replaced(recorded, tmp_path):
    stale = tmp_path / "step_000003.tmp"
    stale.mkdir()
    (stale / "junk").write_text("left by a killed run")
    old = tmp_path / "step_000003"
    old.mkdir()
    (old / "old").write_text("an older save of step 3")
    model, opt = model_and_optimizer(0)
    path = ckpt.save(tmp_path, 3, model, opt, recorded.group, trainer_state={}, rank_state={})
    assert path == old and not stale.exists()
    assert "junk" not in os.listdir(path) and "old" not in os.listdir(path)
    assert ckpt.trainer_state(path) == {}


def test_a_rank_other_than_0_writes_only_its_rng_state_into_rank_0s_temporary(recorded, tmp_path):
    tmp = tmp_path / "step_000005.tmp"
    tmp.mkdir()  # made by rank 0 before the first barrier
    (tmp / "from rank 0").write_text("")
    recorded.rank = 1
    model, opt = model_and_optimizer(0)
    path = ckpt.save(
        tmp_path, 5, model, opt, recorded.group, trainer_state=TRAINER, rank_state=RANK
    )
    assert path == tmp_path / "step_000005" and not path.exists()  # rank 0 renames it
    names = set(os.listdir(tmp))
    assert {"from rank 0", "rng_rank1.pt"} <= names and "trainer.pt" not in names
    assert "rng_rank0.pt" not in names
    assert recorded.log.count("barrier") == 3


def test_loading_on_a_rank_the_checkpoint_has_no_rng_state_for_is_refused(recorded, tmp_path):
    model, opt = model_and_optimizer(0)
    path = ckpt.save(tmp_path, 1, model, opt, recorded.group, trainer_state={}, rank_state=RANK)
    recorded.rank = 1
    with pytest.raises(ValueError, match=r"no rng_rank1\.pt: it was written by fewer train ranks"):
        ckpt.load(path, *model_and_optimizer(1), recorded.group)


def test_the_model_is_read_whole_without_a_process_group(recorded, tmp_path, monkeypatch):
    model, opt = model_and_optimizer(0)
    path = ckpt.save(tmp_path, 2, model, opt, recorded.group, trainer_state={}, rank_state={})
    recorded.log.clear()
    other, _ = model_and_optimizer(1)
    ckpt.load_model(path, other)
    assert recorded.log == [("load", path, None, True)]
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_checkpoint_folder_is_named_by_its_six_digit_step():
    assert ckpt.checkpoint_dir(Path("c"), 20) == Path("c/step_000020")
    assert ckpt.checkpoint_dir(Path("c"), 1234567) == Path("c/step_1234567")


def test_the_latest_checkpoint_is_the_highest_whole_step(tmp_path):
    runs = tmp_path / "checkpoints"
    assert ckpt.latest(tmp_path) is None  # no folder yet
    for name, whole in [("step_000002", True), ("step_000010", True), ("step_000011", False),
                        ("step_000012.tmp", True), ("step_000009", True)]:  # fmt: skip
        (runs / name).mkdir(parents=True)
        if whole:
            (runs / name / "trainer.pt").write_text("")
    (runs / "step_000013").write_text("a file")
    assert ckpt.latest(str(tmp_path)) == runs / "step_000010"
    other = tmp_path / "elsewhere" / "step_000001"
    other.mkdir(parents=True)
    (other / "trainer.pt").write_text("")
    assert ckpt.latest(tmp_path, "elsewhere") == other
    assert ckpt.latest(tmp_path / "nothing") is None


@pytest.mark.gpu
def test_states_saved_from_a_gpu_are_read_back_on_the_host(recorded, tmp_path):
    """An RNG or trainer state holding a CUDA tensor is read onto the CPU (map_location), on a
    machine with a GPU as without."""
    model, opt = model_and_optimizer(0)
    t = torch.arange(3.0, device="cuda")
    path = ckpt.save(
        tmp_path, 1, model, opt, recorded.group, trainer_state={"t": t}, rank_state={"t": t}
    )
    assert ckpt.trainer_state(path)["t"].device == torch.device("cpu")
    state = ckpt.load(path, *model_and_optimizer(1), recorded.group)
    assert state["t"].device == torch.device("cpu") and state["t"].tolist() == [0.0, 1.0, 2.0]
