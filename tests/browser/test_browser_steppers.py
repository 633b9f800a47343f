"""A student opens a chapter in JupyterLab, runs it, and steps through a recording.

Chapter 06 steps through the engine's steps (the Recorder's snapshots after each
scheduler/model step). Every chapter's stepper is the same widget (``viz.Stepper``), whose
controls tests/test_viz.py drives without a browser, so one chapter in the browser checks the
front end (chapter 02, stepping through BlockManager calls, ran here too until it cost CI more
than half a minute for the same widget). The chapter runs up to its first stepper -- what a student
runs before reaching it -- with Run All Cells, then on that stepper (at least three steps) press
next, next, previous, drag the slider to the end (a click on the track) and nudge it back with
the keyboard. After every action the label, the printed state and the drawn figure must all be
those of the right step, as computed by the kernel (see stepper_checks.py). Screenshots of the
stepper after each action go to the screenshot folder printed at the end of the run.
"""
from __future__ import annotations

import pytest

from labdriver import NOTEBOOKS
from stepper_checks import load_chapter

CHAPTERS = ["06_engine.ipynb"]


def exercise(stepper) -> None:
    steps = stepper.steps
    last = len(steps) - 1
    assert last >= 2, f"{stepper.name}: a stepper with at least 3 steps is needed, got {len(steps)}"
    # The actions below could not be told apart if neighbouring steps looked the same.
    for a, b in ((0, 1), (1, 2), (last - 1, last)):
        assert steps[a] != steps[b], f"{stepper.name}: steps {a + 1} and {b + 1} show the same thing"

    stepper.expect_step(0, "after-run-all")
    stepper.click("next")
    stepper.expect_step(1, "next")
    stepper.click("next")
    stepper.expect_step(2, "next-again")
    stepper.click("prev")
    stepper.expect_step(1, "previous")
    stepper.slider_to_end()
    stepper.expect_step(last, "slider-to-end")
    stepper.slider_key("ArrowLeft")
    stepper.expect_step(last - 1, "slider-arrow-left")


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_stepper_follows_next_previous_and_slider(page, lab, shots, chapter):
    assert (NOTEBOOKS / chapter).is_file(), f"chapter notebook {chapter} is missing"
    steppers = load_chapter(page, lab, chapter, shots, upto_first_stepper=True)
    stepper = next((s for s in steppers if len(s.steps) >= 3), None)
    assert stepper is not None, f"{chapter}: no stepper with at least 3 steps"
    exercise(stepper)
