"""docs/sync.md's example runs as written and prints what it says."""

from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "sync.md"


def test_sync_doc_example_runs(capsys):
    code = DOC.read_text().split("```python", 1)[1].split("```", 1)[0]
    exec(compile(code, str(DOC), "exec"), {})
    version_line, sqnr_line = capsys.readouterr().out.splitlines()
    assert version_line == "2 63 400448"
    assert sqnr_line.startswith("{'layer.0': 20.4")
