"""Growth seen when it happens: every run ends with the time each tier's tests took and the inner-loop tests (neither
`slow` nor `multiprocess`) whose setup, call or teardown took over SLOW_UNMARKED_S: a report, not a failure
(timings flake on a shared machine). A test over the line gets faster, or gets its mark (tests/README.md)."""

from __future__ import annotations

import time

SLOW_UNMARKED_S = 5.0
INNER, OUTER = "inner loop (not slow and not multiprocess)", "slow or multiprocess"


class TimingReport:
    """Registered on the process that sees every test's report: the controller under xdist, else the only one."""

    def __init__(self):
        self.began = time.monotonic()
        self.seconds = {INNER: 0.0, OUTER: 0.0}
        self.tests = {INNER: 0, OUTER: 0}
        self.unmarked_slow: list[tuple[float, str, str]] = []

    def pytest_runtest_logreport(self, report) -> None:
        tier = OUTER if "slow" in report.keywords or "multiprocess" in report.keywords else INNER
        self.seconds[tier] += report.duration
        self.tests[tier] += report.when == "call"
        if tier == INNER and report.duration > SLOW_UNMARKED_S:
            self.unmarked_slow.append((report.duration, report.when, report.nodeid))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        write = terminalreporter.write_line
        terminalreporter.section("test time by tier")
        write(f"wall time {time.monotonic() - self.began:.1f} s; test time (setup + call + teardown, summed over "
              "workers):")
        for tier in (INNER, OUTER):
            write(f"  {tier}: {self.tests[tier]} tests, {self.seconds[tier]:.1f} s")
        if self.unmarked_slow:
            write(f"inner-loop tests over {SLOW_UNMARKED_S:.0f} s (make them faster, or mark them slow):")
            for seconds, when, nodeid in sorted(self.unmarked_slow, reverse=True):
                write(f"  {seconds:6.2f}s {when:<8} {nodeid}")


def pytest_configure(config) -> None:
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(TimingReport(), "moe_scale_timing_report")
