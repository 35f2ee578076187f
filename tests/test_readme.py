"""The README's API example runs as written."""

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_quantizer_example_runs():
    text = README.read_text()
    section = text.split("## The quantizer in ten lines", 1)[1]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) <= 12
    exec(compile(code, str(README), "exec"), {})


def test_readme_training_step_example_runs():
    text = README.read_text()
    section = text.split("## Load a HF checkpoint, apply a recipe, take a training step", 1)[1]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    exec(compile(code, str(README), "exec"), {})
