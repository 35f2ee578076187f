"""Bad inputs and faults, each refused with one line and nothing changed (tests/faults/harness.py)."""
