"""docs/rl.md's example runs as written."""

from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "rl.md"


def test_rl_doc_example_runs():
    code = DOC.read_text().split("```python", 1)[1].split("```", 1)[0]
    exec(compile(code, str(DOC), "exec"), {})
