"""Suite-wide settings: the GPU skip, the Triton tier's must-run rule, hypothesis profiles.

`make test` runs the suite in three parts (README, "Tests"): the main run, the `capability`
tests again under every other CPU capability, and the `triton` tier in its own process with
TRITON_INTERPRET=1 set before anything imports triton. That process also sets
MXRL_REQUIRE_TRITON=1, under which a `triton` test that skips on a machine without CUDA is a
failure: the tier proves the kernels' byte-exactness in CI, so it may not silently not run.

Each part runs on pytest-xdist workers (`make test XDIST=-n0` runs one process); a worker takes
its share of the cores for torch's intra-op threads, so two workers on two cores do not wait on
each other's threads.
"""

import os

# The Triton interpreter computes tl.dot with NumPy's OpenBLAS, whose kernel (and so its
# summation order) depends on the CPU: one SSE3 kernel on every x86-64 CPU keeps the kernels'
# bytes the same everywhere (the Makefile's Triton tier sets it too). Read when NumPy loads,
# so before anything imports it; a value already in the environment is kept.
os.environ.setdefault("OPENBLAS_CORETYPE", "Prescott")

import pytest
import torch
from hypothesis import settings

REQUIRE_TRITON = os.environ.get("MXRL_REQUIRE_TRITON", "0") == "1"
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER is not None:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _workers))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_TIER_PASSED: list[str] = []


def _tier_must_run(keywords) -> bool:
    """A test (its item's or its report's keywords) of the Triton tier where the tier must run."""
    return REQUIRE_TRITON and "triton" in keywords and not torch.cuda.is_available()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and "gpu" not in item.keywords and _tier_must_run(item.keywords):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (
            f"MXRL_REQUIRE_TRITON=1: this Triton-tier test skipped ({reason}); the tier must run "
            "here: install triton (make does) and set TRITON_INTERPRET=1 before triton is imported"
        )


def pytest_runtest_logreport(report):
    # on the controller under xdist (the workers send their reports there), and in one process
    if report.passed and report.when == "call" and _tier_must_run(report.keywords):
        _TIER_PASSED.append(report.nodeid)


def pytest_collectreport(report):
    # a whole module skipped by importorskip("triton")
    skipped_tier = report.skipped and "triton" in str(report.longrepr)
    if REQUIRE_TRITON and skipped_tier and not torch.cuda.is_available():
        report.outcome = "failed"


def pytest_sessionfinish(session, exitstatus):
    if XDIST_WORKER is not None:  # the controller counts every worker's tests
        return
    if REQUIRE_TRITON and not torch.cuda.is_available() and not _TIER_PASSED:
        print("\nMXRL_REQUIRE_TRITON=1 but no Triton-tier test ran: select them with -m triton")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# Property tests: 40 examples in CI; HYPOTHESIS_PROFILE=thorough for a long local run.
settings.register_profile("ci", max_examples=40, deadline=None)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
