"""`mxrl runs list|show|compare|note`."""

from __future__ import annotations

from mxrl.cli import main


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_list_newest_first(make_run, capsys):
    make_run("old-run", "bf16", start_time="2025-01-01T10:00:00.000Z")
    make_run("new-run", "nvfp4-hp", start_time="2025-03-01T10:00:00.000Z", steps=12)
    code, out, err = run(capsys, "runs", "list", "--root", make_run.root)
    assert code == 0 and err == ""
    header, first, second = out.splitlines()
    assert header.split()[:4] == ["id", "recipe", "steps", "last"]
    assert first.split()[:6] == ["new-run", "nvfp4-hp", "12", "0.32", "finished", "2025-03-01"]
    assert second.split()[:6] == ["old-run", "bf16", "30", "0.68", "finished", "2025-01-01"]


def test_list_empty_and_missing_root(tmp_path, capsys):
    assert run(capsys, "runs", "list", "--root", tmp_path)[:2] == (0, f"no runs under {tmp_path}\n")
    code, out, err = run(capsys, "runs", "list", "--root", tmp_path / "nope")
    assert code == 2 and out == "" and "no runs folder" in err and len(err.splitlines()) == 1


def test_show(make_run, capsys):
    rec = make_run("20250601-120000-abcd", "nvfp4-dequantized", sync_fail_at=3)
    rec.note("reward plateau after step 20")
    code, out, err = run(capsys, "runs", "show", "20250601", "--root", make_run.root)  # a prefix
    assert code == 0 and err == ""
    assert out.startswith("run 20250601-120000-abcd")
    assert "status: finished; 30 steps logged, last step 29" in out
    assert "  grpo.group_size: 8" in out and "  recipe: nvfp4-dequantized" in out
    assert "plan: hash h0" in out
    assert "  backend:  reference" in out and "  commit:   " in out
    assert "last metrics (step 29):" in out
    assert [ln.split() for ln in out.splitlines() if ln.strip().startswith("reward/mean")] == [
        ["reward/mean", "0.68"]
    ]
    assert "events: end 1, quantization 30, spike 1, sync_verified 30" in out
    assert "gradient spikes: 1 (steps 12)" in out
    assert "weight syncs verified: NO (29/30)" in out
    assert "reward plateau after step 20" in out


def test_show_by_path_with_truncated_metrics(make_run, capsys, caplog):
    rec = make_run("r1", steps=3)
    with open(rec.path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rew')
    code, out, _ = run(capsys, "runs", "show", rec.path)
    assert code == 0 and "3 steps logged" in out
    assert "problems reading the record:" in out and "truncated last line" in out
    warned = [r for r in caplog.records if "truncated last line" in r.getMessage()]
    assert len(warned) == 1  # the logger's warning (stderr), once


def test_unknown_id_lists_nearby_ids(make_run, capsys):
    make_run("nvfp4-seed0", steps=2)
    make_run("nvfp4-seed1", steps=2)
    make_run("bf16-seed0", "bf16", steps=2)
    code, out, err = run(capsys, "runs", "show", "nvfp4-sed0", "--root", make_run.root)
    assert code == 2 and out == ""
    assert err.startswith("mxrl: error: no run 'nvfp4-sed0' under ")
    assert "nearby: nvfp4-seed0" in err and len(err.splitlines()) == 1
    code, _, err = run(capsys, "runs", "show", "nvfp4", "--root", make_run.root)
    assert code == 2 and "ambiguous" in err and "nvfp4-seed0, nvfp4-seed1" in err
    code, out, _ = run(capsys, "runs", "show", "16-seed", "--root", make_run.root)  # a part
    assert code == 0 and out.startswith("run bf16-seed0")


def test_compare(make_run, capsys, tmp_path):
    make_run("a", "bf16", spike_at=None, steps=8)
    make_run("b", "mxfp8", steps=8, spike_at=4)
    out_dir = tmp_path / "report"
    code, out, err = run(
        capsys, "runs", "compare", "a", "b", "--out", out_dir, "--root", make_run.root
    )
    assert code == 0, err
    assert out.startswith("| metric | bf16 | mxfp8 |")
    for name in ("reward.png", "mismatch.png", "grad_norm.png", "step_time.png", "comparison.md"):
        assert (out_dir / name).is_file() and f"wrote {out_dir / name}" in out
    code, _, err = run(
        capsys, "runs", "compare", "a", "zz", "--out", out_dir, "--root", make_run.root
    )
    assert code == 2 and "no run 'zz'" in err


def test_note(make_run, capsys):
    rec = make_run("r1", steps=2)
    code, out, _ = run(capsys, "runs", "note", "r1", "bumped lr", "--root", make_run.root)
    assert code == 0 and out == f"noted in {rec.path / 'notes.md'}\n"
    code, _, _ = run(capsys, "runs", "note", rec.path, "second one")
    assert code == 0
    notes = rec.notes()
    assert notes.index("bumped lr") < notes.index("second one")
    code, _, err = run(capsys, "runs", "note", "r1", " ", "--root", make_run.root)
    assert code == 2 and "empty" in err
