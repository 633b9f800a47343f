"""Grade labs from a shell, for a classroom.

    python -m course_pkg.labs list                    every lab: name, chapter, what it checks
    python -m course_pkg.labs LAB path/to/file.py     grade the file's implementation
    python -m course_pkg.labs LAB file.py --json      the same, as one JSON document (autograders)

The file must define the stub's name (``StudentAppendBlockManager`` for ``append``, see
``list``) or name the object with ``--name``. It is imported and graded in a child process
with a limit for the import (wall-clock) and for each scenario (CPU time, and four times that
in wall-clock time; ``course_pkg.labs.isolation``);
the exit status is 0 only when the lab PASSED, 1 when it failed, 2 on a usage error.
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from course_pkg.labs import LABS
from course_pkg.labs.isolation import IMPORT_LIMIT, SCENARIO_LIMIT, grade_file


def _list() -> int:
    for lab in LABS.values():
        stub = lab.stub_path.rpartition(":")[2]
        print(f"{lab.name:<18} chapter {lab.chapter:02d}  {lab.title}")
        print(f"{'':<18} write: {lab.task.replace('`', '')} (start from {stub})")
        print(textwrap.fill(f"checks: {lab.checks}", width=100, initial_indent=" " * 19,
                            subsequent_indent=" " * 27))
    return 0


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds in (0, 3600]")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_pkg.labs",
                                     description="List the course's labs, or grade a student's file.")
    parser.add_argument("lab", help="'list', or the name of a lab")
    parser.add_argument("file", nargs="?", type=Path, help="the Python file to grade")
    parser.add_argument("--name", help="the object in the file to grade (default: the stub's name)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON, one record per scenario")
    parser.add_argument("--import-limit", type=_seconds, default=IMPORT_LIMIT, metavar="S",
                        help=f"seconds the file may take to import (default {IMPORT_LIMIT:g})")
    parser.add_argument("--scenario-limit", type=_seconds, default=SCENARIO_LIMIT, metavar="S",
                        help=f"seconds of CPU time each scenario may use (default {SCENARIO_LIMIT:g})")
    args = parser.parse_args(argv)
    if args.lab == "list":
        return _list()
    if args.lab not in LABS:
        parser.error(f"no lab named {args.lab!r}; run 'python -m course_pkg.labs list'")
    if args.file is None:
        parser.error("give the file to grade")
    if not args.file.is_file():
        parser.error(f"{args.file} is not a file")
    lab = LABS[args.lab]
    try:
        report = grade_file(lab, args.file, args.name or lab.stub_path.rpartition(":")[2],
                            import_limit=args.import_limit, scenario_limit=args.scenario_limit)
    except KeyboardInterrupt:
        print(f"lab {lab.name}: FAILED (interrupted; the grading process was stopped)")
        return 130
    print(json.dumps(report.to_json(), indent=1) if args.json else report)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
