"""The suite's own plumbing: which tests share an xdist worker (tests/parallel.py) and the report every run ends
with (tests/timing_report.py)."""

from __future__ import annotations

from types import SimpleNamespace

from tests import timing_report
from tests.parallel import grouped_files, unit_of_work
from tests.paths import REPO


def test_a_file_with_a_shared_fixture_is_one_unit_and_any_other_test_its_own():
    """(A worker also refuses to start when a test uses a shared fixture from a file grouped_files misses.)"""
    grouped = grouped_files(REPO)
    assert {"tests/distributed/test_slurm_integration.py", "tests/commands/test_model_kinds.py"} <= grouped
    assert "tests/test_config.py" not in grouped and "tests/test_parallel.py" not in grouped
    slurm = "tests/distributed/test_slurm_integration.py"
    assert unit_of_work(f"{slurm}::test_cpu_template_trains_under_real_slurm", grouped) == slurm
    assert unit_of_work(f"{slurm}::test_deepspeed_template_trains_under_real_slurm", grouped) == slurm
    other = "tests/test_config.py::test_cli_flags[a-b]"
    assert unit_of_work(other, grouped) == other


def _report(nodeid: str, when: str, seconds: float, *marks: str):
    return SimpleNamespace(nodeid=nodeid, when=when, duration=seconds, keywords=dict.fromkeys(marks, 1))


def test_the_run_ends_with_each_tiers_time_and_the_unmarked_tests_over_the_line():
    report = timing_report.TimingReport()
    line = timing_report.SLOW_UNMARKED_S
    for r in (_report("t.py::fast", "call", 0.5), _report("t.py::fast", "setup", 0.25),
              _report("t.py::heavy", "call", line + 2, "slow"), _report("t.py::ranks", "call", 3.0, "multiprocess"),
              _report("t.py::creeping", "call", line + 1), _report("t.py::fixture", "setup", line + 0.5)):
        report.pytest_runtest_logreport(r)
    lines: list[str] = []
    report.pytest_terminal_summary(SimpleNamespace(section=lambda title: lines.append(f"== {title}"),
                                                   write_line=lines.append))
    assert lines[0] == "== test time by tier"
    assert f"  {timing_report.INNER}: 2 tests, {0.75 + line + 1 + line + 0.5:.1f} s" in lines
    assert f"  {timing_report.OUTER}: 2 tests, {line + 2 + 3.0:.1f} s" in lines
    assert [entry.split()[-1] for entry in lines if entry.startswith("  ") and "t.py::" in entry] == \
        ["t.py::creeping", "t.py::fixture"]   # the slowest first; marked tests are not listed
