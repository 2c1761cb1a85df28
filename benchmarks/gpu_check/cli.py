"""`python -m benchmarks.gpu_check`: its options, and the steps in their order."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import gpu_check
from benchmarks.gpu_check.check import Check
from benchmarks.gpu_check.plan import REPO, RESULTS, WORK
from benchmarks.gpu_check.stopping import stoppable
from benchmarks.gpu_check.travel import prepare


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check",
        description=(gpu_check.__doc__ or "").split("\n\n")[0],
    )
    p.add_argument("--prepare", type=Path, help="download the wheels that travel into DIR")
    p.add_argument("--python", default="3.12", help="--prepare's Python version; default 3.12")
    p.add_argument("--wheels", type=Path, help="install from these wheels first")
    p.add_argument("--dry-run", action="store_true", help="the same steps on the CPU")
    p.add_argument("--seconds", type=float, default=4.0, help="per measurement; default 4")
    p.add_argument("--out", type=Path, help="results file (default: see the module)")
    p.add_argument(
        "--logs",
        type=Path,
        default=WORK,
        help="the tests' report; default " + str(WORK.relative_to(REPO)),
    )
    p.add_argument(
        "--no-tests", action="store_true", help="leave out the GPU tests (the longest step)"
    )
    args = p.parse_args(argv)
    if args.prepare is not None:
        return prepare(args.prepare, args.python)
    check = Check(args.dry_run, args.wheels, args.seconds)
    check.logs = args.logs
    check.out = args.out or (
        WORK / "gpu-dry-run.json" if args.dry_run else RESULTS / f"gpu-{check.when}.json"
    )
    WORK.mkdir(parents=True, exist_ok=True)
    return stoppable(check, lambda: _steps(check, args))


def _steps(check: Check, args: argparse.Namespace) -> int:
    """The steps in their order (see the module); 0 when every step was ok."""
    # Installing comes first: torch, once imported, would not see a numpy installed after it.
    check.step("install", check.install)
    check.step("environment", check.environment)
    if not (check.steps["install"]["ok"] and check.steps["environment"]["ok"]):
        return _write(check, args)
    check.step("archives", check.make_archives)
    if check.steps["archives"]["ok"]:
        check.step("loads", check.loads)
        check.step("benchmark", check.benchmark)
        check.step("served", check.served)
    if not args.no_tests:
        check.step("tests", check.tests)
    return _write(check, args)


def _write(check: Check, args: argparse.Namespace) -> int:
    """The results file, once more at the end; 0 when every step was ok."""
    assert check.out is not None
    ok = check.write(check.out)
    print(f"[gpu-check] results: {check.out}")
    return 0 if ok else 1
