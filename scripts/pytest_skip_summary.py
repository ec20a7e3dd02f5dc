"""pytest plugin (``-p scripts.pytest_skip_summary``): one line per skip reason with its count, after the run.

pytest's own ``-rs`` lists a line per (file, line, reason); a suite whose GPU tests skip in many files
then prints hundreds of lines. This groups the skips by reason alone, most frequent first.
"""

from collections import Counter


def skip_reason(report) -> str:
    """The reason a skipped test or collector gave, without pytest's ``Skipped: `` prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter):
    counts = Counter(skip_reason(r) for r in terminalreporter.stats.get("skipped", []))
    if not counts:
        return
    terminalreporter.write_sep("-", f"{sum(counts.values())} skipped, by reason")
    for reason, n in counts.most_common():
        terminalreporter.write_line(f"{n:6d}  {reason}")
