"""A pytest plugin for runs that may be cut off (a lent GPU's time limit): each failure's
report is appended to $FAIL_LOG the moment it happens, not in the summary at the end.
Use: PYTHONPATH=tools pytest -p pytest_failures_now ..."""

import os


def pytest_runtest_logreport(report):  # noqa: ANN001, ANN201 - pytest hook
    if report.failed:
        with open(os.environ.get("FAIL_LOG", "failures.log"), "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
