"""Pytest plugin for scripts/gpu_check.sh: a test module that cannot be imported because bitsandbytes or torchao is
missing is reported as skipped, with a line saying so, instead of failing the collection (a GPU machine need not
have them; the course falls back to torch's optimizers without them)."""
from __future__ import annotations

import pytest

OPTIONAL = ("bitsandbytes", "torchao")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    text = str(report.longrepr)
    missing = [name for name in OPTIONAL if f"No module named '{name}" in text]
    if missing:
        report.outcome = "skipped"
        report.longrepr = (str(collector.path), 0, f"Skipped: {collector.path.name} imports {missing[0]}, which is "
                           "not installed here: its tests did not run")
