"""tests/support/'s stderr filter: only nanobind's leak report goes."""

from __future__ import annotations

import io

from tests.support import filter_nanobind_leak_report


def test_only_the_nanobind_leak_report_is_dropped():
    src = io.StringIO("FAILED tests/x.py::t\nnanobind: leaked 2 instances!\n - leaked instance 0x1 of type \"a\"\n"
                      " - ... skipped remainder\nnanobind: leaked 1 functions!\n - leaked function \"f\"\n"
                      "nanobind: this is likely caused by a reference counting issue in the binding code.\n"
                      "See https://nanobind.readthedocs.io/en/latest/refleaks.html\n"
                      "Exception ignored in: <function f>\n - leaked by nobody\n")
    dst = io.StringIO()
    filter_nanobind_leak_report(src, dst)
    assert dst.getvalue() == "FAILED tests/x.py::t\nException ignored in: <function f>\n - leaked by nobody\n"
