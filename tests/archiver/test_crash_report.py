"""A crash in native code (a compiled model, a GPU runtime) is reported with the Python stack of
the command that crashed, even where the compiled model's own messages are dropped from stderr."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CRASHING_CHILD = textwrap.dedent(
    """
    import ctypes

    from scriptserve.archiver.cli import report_crashes
    from scriptserve.archiver.pt2_check import _runtime_stderr_dropped

    def call_into_the_compiled_model():
        with _runtime_stderr_dropped():  # as around every run of a package in model-archiver
            ctypes.string_at(0)  # a read through a null pointer: SIGSEGV

    report_crashes()
    call_into_the_compiled_model()
    """
)


def test_a_native_crash_prints_the_stack_although_stderr_is_dropped_around_the_call() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CRASHING_CHILD],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == -11
    assert "Fatal Python error: Segmentation fault" in done.stderr
    assert "call_into_the_compiled_model" in done.stderr


def test_without_the_report_the_same_crash_says_nothing() -> None:
    """What the report is for: the crash above, unreported, leaves an empty stderr."""
    child = CRASHING_CHILD.replace("report_crashes()\n", "")
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == -11
    assert done.stderr == ""
