"""Small helpers the chapter notebooks share: show the package's code, check an exercise.

``check`` is strict on purpose: an exercise that asks for a number of blocks wants an ``int``,
and ``True``, ``1.0`` or ``"1"`` are other answers (Python's ``==`` would accept the first
two). A float is only ever compared within a tolerance that the exercise states.
"""
from __future__ import annotations

import inspect
import math
import textwrap


def show_source(obj) -> "IPython.display.Code":
    """Display the source of a package function or class, highlighted.

    The notebooks *show* the package's code instead of copying it, so what the reader reads
    is what runs. The plain-text form is the source itself, so nbval notices when it changes.
    """
    from IPython.display import Code

    return Code(textwrap.dedent(inspect.getsource(obj)), language="python")


def show_lines(obj, start: str, stop: str | None = None) -> "IPython.display.Code":
    """Display an excerpt of ``obj``'s source: from the first line containing ``start`` up to
    and including the first later line containing ``stop`` (to the end when ``stop`` is None).

    Markers are text, not line numbers, so an excerpt follows the code when lines move; a
    marker that is not found raises ``ValueError`` (the excerpt would silently show the wrong
    lines otherwise).
    """
    from IPython.display import Code

    lines = textwrap.dedent(inspect.getsource(obj)).splitlines()
    first = _find_line(lines, start, 0, obj)
    last = len(lines) - 1 if stop is None else _find_line(lines, stop, first + 1, obj)
    return Code(textwrap.dedent("\n".join(lines[first:last + 1])), language="python")


def _find_line(lines: list[str], marker: str, begin: int, obj) -> int:
    for i in range(begin, len(lines)):
        if marker in lines[i]:
            return i
    name = getattr(obj, "__qualname__", repr(obj))
    raise ValueError(f"no line containing {marker!r} in the source of {name} (from line {begin + 1} on)")


def same_answer(answer, expected, tolerance: float | None = None) -> bool:
    """``answer`` equals ``expected`` with the same type at every level (``True`` is not ``1``,
    ``1.0`` is not ``1``, a list is not a tuple). Floats compare within ``tolerance``
    (absolute); without one, a float in ``expected`` raises ``ValueError``: the exercise must
    say how close is close enough."""
    if isinstance(expected, float):
        if tolerance is None:
            raise ValueError("a float answer needs a stated tolerance: check(..., tolerance=...)")
        if type(answer) is not type(expected):
            return
        return math.isfinite(answer) and abs(answer - expected) <= tolerance
    if type(answer) is not type(expected):
        return
    if isinstance(expected, (list, tuple)):
        return len(answer) == len(expected) and all(
            same_answer(a, e, tolerance) for a, e in zip(answer, expected))
    if isinstance(expected, dict):
        return answer.keys() == expected.keys() and all(
            same_answer(answer[k], expected[k], tolerance) for k in expected)
    if isinstance(expected, (set, frozenset)):
        return answer == expected and all(type(a) in {type(e) for e in expected} for a in answer)
    return answer == expected


def _kind(value) -> str:
    return type(value).__name__


def _a_kind(value) -> str:
    """``"an int"``, ``"a list"``: the type's name with its article."""
    kind = _kind(value)
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def check(answer, expected, hint: str = "", *, tolerance: float | None = None) -> None:
    """Self-check for an exercise: prints whether ``answer`` is ``expected``.

    Leave ``answer`` as ``...`` (Ellipsis) until you have one. The comparison is type-strict
    (see ``same_answer``); ``tolerance`` is the absolute error allowed for floats.
    """
    if answer is ...:
        print("Not answered yet: replace ... with your answer and run the cell again.")
        return
    if same_answer(answer, expected, tolerance):
        print("Correct." if tolerance is None else f"Correct (within {tolerance:g}).")
        return
    if type(answer) is not type(expected) and not isinstance(expected, (list, tuple, dict, set)):
        print(f"Not quite: got {answer!r}, {_a_kind(answer)}; the answer is {_a_kind(expected)}."
              + (f" Hint: {hint}" if hint else ""))
    else:
        print(f"Not quite: got {answer!r}." + (f" Hint: {hint}" if hint else ""))


def predict(answer, experiment, hint: str = "", *, tolerance: float | None = None) -> None:
    """Self-check for a predict-then-verify exercise: ``answer`` is the reader's prediction,
    ``experiment`` a function that runs the package and returns what really happens.

    The experiment runs only once there is a prediction (``answer`` is no longer ``...``), so
    the measured value is never on the page before the reader has committed to one; then both
    are printed. The comparison is ``same_answer``'s (type-strict: ``True`` is not ``1``).
    """
    if answer is ...:
        print("Not answered yet: write your prediction in place of ... and run the cell again "
              "(the experiment runs then).")
        return
    measured = experiment()
    if same_answer(answer, measured, tolerance):
        print(f"Correct: you predicted {answer!r}, the package gives {measured!r}.")
        return
    kind = (f" ({_a_kind(answer)}; the answer is {_a_kind(measured)})"
            if type(answer) is not type(measured) else "")
    print(f"Not quite: you predicted {answer!r}{kind}; the package gives {measured!r}."
          + (f" Why: {hint}" if hint else ""))


def check_function(fn, reference, cases, hint: str = "", *, tolerance: float | None = None) -> None:
    """Self-check for an exercise that asks for code: call ``fn(*case)`` and
    ``reference(*case)`` for every case and print the first case where they differ.

    ``fn`` still holding only ``...`` (it returns None) counts as not answered yet.
    """
    cases = [c if isinstance(c, tuple) else (c,) for c in cases]
    for case in cases:
        got = fn(*case)
        if got is None:
            print("Not answered yet: write the function's body and run the cell again.")
            return
        want = reference(*case)
        if not same_answer(got, want, tolerance):
            args = ", ".join(map(repr, case))
            print(f"Not quite: {fn.__name__}({args}) returned {got!r} ({_kind(got)}), "
                  f"expected {want!r} ({_kind(want)})." + (f" Hint: {hint}" if hint else ""))
            return
    print(f"Correct on all {len(cases)} cases." if tolerance is None
          else f"Correct on all {len(cases)} cases (within {tolerance:g}).")
