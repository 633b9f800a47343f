"""Small helpers the chapter notebooks share: show the package's code, check an exercise."""
from __future__ import annotations

import inspect
import textwrap


def show_source(obj) -> "IPython.display.Code":
    """Display the source of a package function or class, highlighted.

    The notebooks *show* the package's code instead of copying it, so what the reader reads
    is what runs. The plain-text form is the source itself, so nbval notices when it changes.
    """
    from IPython.display import Code

    return Code(textwrap.dedent(inspect.getsource(obj)), language="python")


def check(answer, expected, hint: str = "") -> None:
    """Self-check for an exercise: prints whether ``answer`` equals ``expected``.

    Leave ``answer`` as ``...`` (Ellipsis) until you have one.
    """
    if answer is ...:
        print("Not answered yet: replace ... with your answer and run the cell again.")
    elif answer == expected:
        print("Correct.")
    else:
        print(f"Not quite: got {answer!r}." + (f" Hint: {hint}" if hint else ""))
