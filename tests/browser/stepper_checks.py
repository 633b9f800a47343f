"""Check a chapter's Stepper in JupyterLab against what the kernel says each step must show.

The expectations come from the kernel, not from the widget: a probe cell, appended to the
*temporary copy* of the chapter, finds every live ``Stepper`` and writes, for each step, the
snapshot's label, ``render_text(snapshot)`` and the SHA-256 of a freshly drawn PNG of that
snapshot (``figure_png(draw_snapshot(snapshot))``, not the widget's cached image). The browser
side reads what the page shows: the label, the ``<pre>`` text and the bytes of the ``<img>``.
So the check fails if the page does not move, moves to the wrong step, or shows one step's
text with another step's figure.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import expect

from labdriver import LabServer, clear_outputs, open_notebook, run_all_cells

EXPECTATIONS = "_stepper_expectations.json"

PROBE_SOURCE = f'''\
# Added by the browser test to its temporary copy: what each Stepper must show at each step.
import hashlib as _hashlib, json as _json
from ipywidgets.widgets.widget import _instances as _widget_instances
from course_pkg.viz import Stepper as _Stepper, draw_snapshot as _draw, figure_png as _png, render_text as _text
_expect = []
for _st in [_w for _w in list(_widget_instances.values()) if isinstance(_w, _Stepper)]:
    _expect.append({{"steps": [{{"label": _s.label, "text": _text(_s),
                               "png_sha256": _hashlib.sha256(_png(_draw(_s), dpi=_st._dpi)).hexdigest()}}
                              for _s in _st.snapshots]}})
with open({EXPECTATIONS!r}, "w") as _f:
    _json.dump(_expect, _f)
'''

# What one stepper in the page shows now. The figure is an <img> whose src is a blob: or
# data: URL; its bytes are fetched and hashed in the page.
_READ_JS = """async (box) => {
    const q = (sel) => box.querySelector(sel);
    const img = q('img.stepper-figure') || q('.stepper-figure img');
    let sha = null;
    if (img && img.src) {
        const buf = await (await fetch(img.src)).arrayBuffer();
        const digest = new Uint8Array(await crypto.subtle.digest('SHA-256', buf));
        sha = Array.from(digest).map(b => b.toString(16).padStart(2, '0')).join('');
    }
    const readout = q('.stepper-slider .widget-readout');
    return {label: (q('.stepper-label') || {innerText: ''}).innerText.trim(),
            text: (q('.stepper-text pre') || {textContent: null}).textContent,
            png_sha256: sha,
            slider: readout ? readout.textContent.trim() : null};
}"""


# True once the figure's bytes hash to the expected SHA-256. page.wait_for_function needs a
# synchronous predicate (a Promise would count as "true" at once), so each poll starts hashing
# the current image if it has not been hashed yet and compares the hash when it is ready.
_FIGURE_IS_JS = """([box, sha]) => {
    const img = box.querySelector('img.stepper-figure') || box.querySelector('.stepper-figure img');
    if (!img || !img.src) return false;
    const memo = box.__courseFigure;
    if (!memo || memo.src !== img.src) {
        const entry = {src: img.src, sha: null};
        box.__courseFigure = entry;
        fetch(img.src).then(r => r.arrayBuffer()).then(buf => crypto.subtle.digest('SHA-256', buf))
            .then(d => { entry.sha = Array.from(new Uint8Array(d)).map(b => b.toString(16).padStart(2, '0')).join(''); });
        return false;
    }
    return memo.sha === sha;
}"""


def add_probe(notebook: Path, upto_first_stepper: bool = False) -> None:
    """Append the probe cell to ``notebook`` (a temporary copy); with ``upto_first_stepper``,
    after the first cell that builds a ``Stepper``, the cells after it dropped: what a student
    runs before reaching the first stepper, which is all the front end needs (every later
    stepper is the same widget)."""
    nb = nbformat.read(notebook, as_version=4)
    if upto_first_stepper:
        first = next(i for i, c in enumerate(nb.cells)
                     if c.cell_type == "code" and re.search(r"\bStepper\(", c.source))
        nb.cells = nb.cells[:first + 1]
    nb.cells.append(nbformat.v4.new_code_cell(PROBE_SOURCE))
    nbformat.write(nb, notebook)


def shows_step(shown: dict, steps: list[dict], index: int) -> list[str]:
    """What differs between the page (``shown``) and step ``index``; empty when it matches."""
    expected = steps[index]
    problems = []
    if f"step {index + 1} of {len(steps)}" not in shown["label"] or expected["label"] not in shown["label"]:
        problems.append(f"label {shown['label']!r} is not step {index + 1} of {len(steps)} "
                        f"({expected['label']!r})")
    if shown["text"] != expected["text"]:
        problems.append(f"text is not render_text(step {index + 1}); shown: {(shown['text'] or '')[:300]!r}")
    if shown["png_sha256"] != expected["png_sha256"]:
        problems.append(f"figure is not the figure of step {index + 1}")
    if shown["slider"] != str(index):
        problems.append(f"slider reads {shown['slider']!r}, expected {index}")
    return problems


class StepperOnPage:
    """One `.course-stepper` in the page, with the kernel's expectations for its steps."""

    def __init__(self, page, box, steps: list[dict], shots: Path, name: str):
        self.page, self.box, self.steps, self.shots, self.name = page, box, steps, shots, name
        self.index = 0
        self._shot = 0

    def read(self) -> dict:
        return self.box.evaluate(_READ_JS)

    def expect_step(self, index: int, action: str) -> None:
        """Wait until the page shows step ``index`` (Playwright's auto-waiting ``expect``), then
        compare label, text, figure and slider exactly; fail naming every difference."""
        want, n = self.steps[index], len(self.steps)
        label = self.box.locator(".stepper-label")
        try:
            expect(label).to_contain_text(f"step {index + 1} of {n}")
            expect(label).to_contain_text(want["label"])
            expect(self.box.locator(".stepper-text pre")).to_have_text(want["text"])
            expect(self.box.locator(".stepper-slider .widget-readout")).to_have_text(str(index))
            self.page.wait_for_function(_FIGURE_IS_JS, arg=[self.box.element_handle(), want["png_sha256"]],
                                        polling=100)
        except (AssertionError, PlaywrightError):
            pass  # reported below, with every difference at once
        problems = shows_step(self.read(), self.steps, index)
        if problems:
            self.screenshot(f"FAILED-after-{action}")
            raise AssertionError(f"{self.name}: after {action}, the stepper does not show step "
                                 f"{index + 1}: " + "; ".join(problems))
        self.index = index
        self.screenshot(action)

    def screenshot(self, action: str) -> None:
        self._shot += 1
        self.box.scroll_into_view_if_needed()
        self.box.screenshot(path=self.shots / f"{Path(self.name).stem}-{self._shot:02d}-{action}.png")

    def click(self, which: str) -> None:
        self.box.locator(f".stepper-{which}").click()

    def slider_to_end(self) -> None:
        """Click the slider's track at its right end (noUiSlider moves the handle there)."""
        track = self.box.locator(".stepper-slider .noUi-target").bounding_box()
        self.page.mouse.click(track["x"] + track["width"] - 1, track["y"] + track["height"] / 2)

    def slider_key(self, key: str) -> None:
        self.box.locator(".stepper-slider .noUi-handle").focus()
        self.page.keyboard.press(key)


def load_chapter(page, lab: LabServer, name: str, shots: Path,
                 upto_first_stepper: bool = False) -> list[StepperOnPage]:
    """Open chapter ``name`` in JupyterLab, run all cells (up to its first stepper, if asked),
    and pair each stepper in the page with the kernel's expectations (matched by its number of
    steps and its first step)."""
    clear_outputs(lab.root / name)
    add_probe(lab.root / name, upto_first_stepper)
    open_notebook(page, lab, name)
    run_all_cells(page, lab, name)
    expectations = json.loads((lab.root / Path(name).parent / EXPECTATIONS).read_text())
    assert expectations, f"{name}: the kernel holds no Stepper after running all cells"
    boxes = page.locator(".course-stepper")
    assert boxes.count() >= 1, f"{name}: no .course-stepper in the page after running all cells"
    return [StepperOnPage(page, boxes.nth(i), _match(boxes.nth(i), expectations, name, i), shots, name)
            for i in range(boxes.count())]


def _match(box, expectations: list[dict], name: str, position: int) -> list[dict]:
    """The expectations whose first step this stepper shows (once it has rendered step 1)."""
    expect(box.locator(".stepper-label")).to_contain_text("step 1 of ")
    shown = box.evaluate(_READ_JS)
    for candidate in expectations:
        if not shows_step(shown, candidate["steps"], 0):
            return candidate["steps"]
    raise AssertionError(f"{name}: stepper #{position + 1} in the page does not show the first "
                         f"step of any Stepper the kernel holds; it shows {shown['label']!r}")
