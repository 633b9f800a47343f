"""Grade labs from a shell, for a classroom.

    python -m course_pkg.labs list                    every lab: name, chapter, what it checks
    python -m course_pkg.labs LAB path/to/file.py     grade the file's implementation; exit 1 on failure

The file must define the stub's name (``StudentAppendBlockManager`` for ``append``, see
``list``) or name the object with ``--name``.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import textwrap
from pathlib import Path

from course_pkg.labs import LABS
from course_pkg.labs.lab import resolve


def _list() -> int:
    for lab in LABS.values():
        stub = lab.stub_path.rpartition(":")[2]
        print(f"{lab.name:<18} chapter {lab.chapter:02d}  {lab.title}")
        print(f"{'':<18} write: {lab.task.replace('`', '')} (start from {stub})")
        print(textwrap.fill(f"checks: {lab.checks}", width=100, initial_indent=" " * 19,
                            subsequent_indent=" " * 27))
    return 0


def _load(path: Path, attribute: str):
    spec = importlib.util.spec_from_file_location(f"student_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path} as a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, attribute):
        raise SystemExit(f"{path} defines no {attribute!r} (name it so, or pass --name)")
    return getattr(module, attribute)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_pkg.labs",
                                     description="List the course's labs, or grade a student's file.")
    parser.add_argument("lab", help="'list', or the name of a lab")
    parser.add_argument("file", nargs="?", type=Path, help="the Python file to grade")
    parser.add_argument("--name", help="the object in the file to grade (default: the stub's name)")
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
    resolve(lab.grader_path)         # first: a kernel lab switches Triton to its interpreter here
    impl = _load(args.file, args.name or lab.stub_path.rpartition(":")[2])
    report = lab.grade(impl)
    print(report)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
