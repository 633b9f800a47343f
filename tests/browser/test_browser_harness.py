"""The harness itself, on a tiny notebook made here: JupyterLab runs it, widgets answer clicks.

If this fails, the browser set-up is broken (not the course's steppers): it separates the two.
The probe widget is wired like the course's Stepper (previous / next buttons and a slider
moving one step index, a label showing it) but built from plain ipywidgets.
"""
from __future__ import annotations

import nbformat
import pytest

from playwright.sync_api import expect

from labdriver import open_notebook, run_all_cells

PROBE_SOURCE = '''\
import ipywidgets as w
label = w.HTML("step 0").add_class("probe-label")
slider = w.IntSlider(min=0, max=4, value=0).add_class("probe-slider")
nxt = w.Button(description="next").add_class("probe-next")
prv = w.Button(description="previous").add_class("probe-prev")
slider.observe(lambda change: setattr(label, "value", f"step {change['new']}"), names="value")
nxt.on_click(lambda _: setattr(slider, "value", min(slider.max, slider.value + 1)))
prv.on_click(lambda _: setattr(slider, "value", max(slider.min, slider.value - 1)))
w.VBox([label, w.HBox([prv, slider, nxt])]).add_class("probe-box")
'''


def test_lab_runs_a_notebook_and_widgets_answer(page, lab, shots):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python",
                                 "name": "python3"}
    nb.cells = [nbformat.v4.new_markdown_cell("# Probe"),
                nbformat.v4.new_code_cell("print(6 * 7)"),
                nbformat.v4.new_code_cell(PROBE_SOURCE)]
    nbformat.write(nb, lab.root / "_harness_probe.ipynb")

    open_notebook(page, lab, "_harness_probe.ipynb")
    cells = run_all_cells(page, lab, "_harness_probe.ipynb")
    assert [c["prompt"] for c in cells] == ["[1]:", "[2]:"]
    assert page.locator(".jp-OutputArea-output", has_text="42").count() == 1

    label = page.locator(".probe-label")
    expect(label).to_have_text("step 0")
    page.locator(".probe-next").click()
    expect(label).to_have_text("step 1")
    page.locator(".probe-slider .noUi-handle").focus()
    page.keyboard.press("ArrowRight")
    expect(label).to_have_text("step 2")
    page.locator(".probe-prev").click()
    expect(label).to_have_text("step 1")
    page.locator(".probe-box").screenshot(path=shots / "harness_probe.png")

    assert len(lab.running_kernels()) == 1  # this test's kernel; the page fixture shuts it down


def test_a_cell_that_raises_is_reported_not_waited_on(page, lab):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python",
                                 "name": "python3"}
    nb.cells = [nbformat.v4.new_code_cell("x = 1"),
                nbformat.v4.new_code_cell("raise ValueError('planted failure')"),
                nbformat.v4.new_code_cell("y = 2")]
    nbformat.write(nb, lab.root / "_harness_raises.ipynb")

    open_notebook(page, lab, "_harness_raises.ipynb")
    with pytest.raises(AssertionError, match="(?s)code cell 2 did not run.*ValueError: planted failure"):
        run_all_cells(page, lab, "_harness_raises.ipynb", timeout=60)
