"""Build it yourself: graded labs for every chapter.

Each lab leaves out the body of one thing a chapter teaches -- ``Block.reset``, ``can_append``,
the O(1) free queue, the prefix lookup, a Triton kernel, the scheduler -- and grades what you
write the way the package itself is tested: hand-computed expectations from the contract,
invariants after every call, the bug scenarios, lockstep runs against the package's code, the
float64 reference kernel, and measured gates where the chapter is about speed.

    from course_pkg.labs import LABS, show_stub, show_solution
    show_stub("append")                            # the code to start from
    LABS["append"].grade(MyBlockManager)           # a LabReport: passed, failures
    show_solution("append")                        # the package's own code, collapsed

From a shell: ``python -m course_pkg.labs list`` and ``python -m course_pkg.labs LAB file.py``.
"""
from __future__ import annotations

import html
import inspect
import textwrap

from course_pkg.labs.lab import Grading, Lab, LabReport
from course_pkg.labs.registry import LABS, labs_of_chapter

__all__ = ["Grading", "Lab", "LabReport", "LABS", "Solution", "grade", "labs_of_chapter", "show_solution",
           "show_stub", "source_of"]


def grade(name: str, impl) -> LabReport:
    """Grade ``impl`` on lab ``name`` (``LABS[name].grade(impl)``)."""
    return _lab(name).grade(impl)


def _lab(name: str) -> Lab:
    if name not in LABS:
        raise KeyError(f"no lab named {name!r}; the labs are: {', '.join(LABS)}")
    return LABS[name]


def source_of(obj) -> str:
    """The source of a function, class, property or Triton kernel, dedented."""
    obj = getattr(obj, "fget", obj)          # a property: its getter
    obj = getattr(obj, "fn", obj)            # a @triton.jit kernel: the Python function
    return textwrap.dedent(inspect.getsource(obj))


def show_stub(name: str):
    """The stub of lab ``name``, highlighted: copy it into a cell and fill in the ``...``."""
    from IPython.display import Code

    return Code(source_of(_lab(name).stub), language="python")


class Solution:
    """The package's code for a lab, collapsed in a ``<details>`` block (plain text: the source)."""

    def __init__(self, lab: Lab):
        self.lab = lab
        self.sources = [source_of(obj) for obj in lab.solution]

    def __repr__(self) -> str:
        return "\n".join(self.sources).rstrip()

    def _repr_html_(self) -> str:
        try:
            from pygments import highlight
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import PythonLexer
            body = "".join(highlight(s, PythonLexer(), HtmlFormatter(noclasses=True)) for s in self.sources)
        except ImportError:  # pragma: no cover -- pygments comes with IPython
            body = "".join(f"<pre>{html.escape(s)}</pre>" for s in self.sources)
        return (f"<details><summary>Solution to <code>{self.lab.name}</code>: the package's own code "
                f"(click to open)</summary>{body}</details>")


def show_solution(name: str) -> Solution:
    """The package's code for lab ``name``, collapsed until clicked."""
    return Solution(_lab(name))
