"""The committed notebooks are executed, in order, and clean of machine-specific data.

nbval checks that the outputs are what the code prints now; this checks what a reader on the
web sees: every code cell ran, top to bottom, without errors, and nothing in the file names
this machine (paths, timings metadata, a local kernel name).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_every_chapter_is_there():
    names = [p.stem for p in NOTEBOOKS]
    for chapter in ["00_overview", "01_block", "02_block_manager", "03_lru_reversed_deallocate", "04_prefix_caching",
                    "05_triton_paged_attention", "06_engine", "07_claims", "08_forks_copy_on_write", "09_scheduling",
                    "10_tensor_parallel", "11_real_traces", "12_sharing_safely", "13_serving", "14_speculative_decoding",
                    "15_offloading", "16_hybrid_models"]:
        assert chapter in names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_executed_in_order_and_clean(path):
    text = path.read_text()
    nb = json.loads(text)
    code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    counts = [c["execution_count"] for c in code]
    assert counts == list(range(1, len(code) + 1)), "cells not executed once each, top to bottom"
    assert any(c["outputs"] for c in code), "committed without outputs"
    for c in code:
        assert not any(o["output_type"] == "error" for o in c["outputs"]), "an error output is committed"
        assert "execution" not in c.get("metadata", {}), "timing metadata is committed"
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    for pattern in [r"/work/", r"/tmp/", r"/root/", r"/home/", r"\.venv/", r"site-packages"]:
        assert not re.search(pattern, text), f"machine-specific path {pattern!r} in {path.name}"
    first = nb["cells"][0]
    assert first["cell_type"] == "markdown" and "".join(first["source"]).startswith("# "), "no title cell"


CHAPTERS = [p for p in NOTEBOOKS if p.stem[:2] in {"00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "12",
                                                   "13", "14", "15", "16"}]


def headings(nb) -> list[str]:
    return [line for c in nb["cells"] if c["cell_type"] == "markdown"
            for line in "".join(c["source"]).splitlines() if line.startswith("#")]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_has_exercises_with_self_checks_and_a_summary(path):
    nb = json.loads(path.read_text())
    heads = headings(nb)
    assert any("exercise" in h.lower() for h in heads), "no exercises section"
    assert any("summary" in h.lower() for h in heads), "no summary section"
    code = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert re.search(r"\b(check|check_function|predict)\(", code), "exercises without a self-check"
    assert "show_source(" in code, "the chapter does not show the package's code"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_written_answers_are_folded(path):
    """An answer written out in the Solutions (a numbered item) sits inside ``<details>``, so a
    reader who scrolls there for the code checks does not read the answers by accident."""
    nb = json.loads(path.read_text())
    cells = nb["cells"]
    start = max(i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                and "".join(c["source"]).startswith("## Solutions"))
    for c in cells[start:]:
        text = "".join(c["source"])
        if c["cell_type"] == "markdown" and re.search(r"^\d+\. ", text, re.MULTILINE):
            before, _, folded = text.partition("<details>")
            assert folded and "</details>" in folded and not re.search(r"^\d+\. ", before, re.MULTILINE), \
                f"{path.name}: answers in the Solutions are not folded in <details>"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_ends_with_references_then_hidden_solutions(path):
    """Summary, References, Solutions: the last three sections, in that order; every solution
    cell is folded (JupyterLab's source_hidden) so a reader meets the exercise first."""
    nb = json.loads(path.read_text())
    top = [h for h in headings(nb) if h.startswith("## ")]
    assert [h.lower() for h in top[-3:]] == ["## summary", "## references", "## solutions"]
    cells = nb["cells"]
    start = max(i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                and "".join(c["source"]).startswith("## Solutions"))
    refs = next(c for c in cells if c["cell_type"] == "markdown" and "".join(c["source"]).startswith("## References"))
    assert "https://" in "".join(refs["source"]), "references without links"
    solution_cells = [c for c in cells[start:] if c["cell_type"] == "code"]
    assert solution_cells and all(c["metadata"].get("jupyter", {}).get("source_hidden") for c in solution_cells)
    assert all(any("Correct" in "".join(o.get("text", "")) for o in c["outputs"]) for c in solution_cells), \
        "a solution cell does not print Correct"
    before = [c for c in cells[:start] if c["cell_type"] == "code"]
    assert not any("Correct" in "".join(o.get("text", "")) for c in before for o in c["outputs"]), \
        "an exercise cell before the solutions is already answered"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_has_an_exercise_that_asks_for_code(path):
    nb = json.loads(path.read_text())
    cells = nb["cells"]
    start = max(i for i, c in enumerate(cells) if "".join(c["source"]).startswith("## Solutions"))
    exercise_code = "".join("".join(c["source"]) for c in cells[:start] if c["cell_type"] == "code")
    assert "check_function(" in exercise_code and "# your code here" in exercise_code


def _time_plan() -> dict[str, list[str]]:
    """Chapter 00's time plan: the first column -> the row's cells."""
    nb = json.loads(next(p for p in NOTEBOOKS if p.stem == "00_overview").read_text())
    text = next("".join(c["source"]) for c in nb["cells"] if "## 6. A time plan for a lecturer" in "".join(c["source"]))
    table = text.split("## 6. A time plan for a lecturer", 1)[1]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.splitlines()
            if line.startswith("|") and not line.startswith("| ---")]
    return {row[0]: row[1:] for row in rows[1:]}


def test_the_time_plan_has_a_row_per_chapter_with_its_labs_and_a_total_that_adds_up():
    from course_pkg.labs import labs_of_chapter

    plan = _time_plan()
    chapters = sorted({p.stem[:2] for p in NOTEBOOKS if re.match(r"\d\d_", p.stem)})
    minutes = lambda cell: int(re.match(r"(\d+) min", cell)[1]) if cell != "—" else 0   # noqa: E731
    for chapter in chapters:
        if int(chapter) >= 12 and chapter not in plan:
            continue          # chapters 12-14 are being written: they add their rows when they land
        assert chapter in plan, f"chapter {chapter} has no row in chapter 00's time plan"
        named = set(re.findall(r"`(\w+)`", plan[chapter][1]))
        assert named == {lab.name for lab in labs_of_chapter(int(chapter))}, (chapter, named)
    rows = [row for name, row in plan.items() if re.fullmatch(r"\d\d", name)]
    [total] = [row for name, row in plan.items() if name.startswith("**")]
    assert f"({sum(minutes(r[0]) for r in rows)} min)" in total[0]
    assert f"({sum(minutes(r[1]) for r in rows)} min)" in total[1]


# A number the prose quotes -- a decimal or a percentage -- must be one the notebook printed: prose
# written from an older run, or from a run on another machine, is caught here. The figures below
# are not the notebook's own measurements: constants, parameters and other people's results.
QUOTED = re.compile(r"(?<![\w.#/-])\d+(?:\.\d+)?%|(?<![\w.#/-])\d+\.\d+(?![\w.])")
SECTION = re.compile(r"(?:section|sections|of|###) (\d+\.\d+)|(\d+\.\d+)-\d+\.\d+ and \d+;|\((\d+\.\d+) shows",
                     re.IGNORECASE)
NOT_MEASURED = {
    "00_overview": {"8.0": "Llama-3-8B's parameter count, in billions",
                    "90%": "vLLM's default gpu_memory_utilization",
                    "3.1": "a section number in the time plan"},
    "08_forks_copy_on_write": {"6.1": "the vLLM paper's figure", "37.6": "the vLLM paper's figure"},
    "09_scheduling": {"0.3": "the workload's arrival rate, a parameter", "4.0": "PCIe 4.0"},
    "12_sharing_safely": {"1.96": "the normal quantile of a 95% interval"},
    "15_offloading": {"5.0": "PCIe 5.0", "0.11": "a vLLM version", "90%": "the share of the bound set as the target, a threshold"},
}


def unmeasured_numbers(nb: dict, allowed: dict) -> list[tuple[int, str]]:
    """(cell, number) for each decimal or percentage in the prose that no output shows."""
    shown = "\n".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                      for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", []))
    found = []
    for i, cell in enumerate(nb["cells"]):
        text = "".join(cell["source"])
        if cell["cell_type"] != "markdown" or text.startswith("## References"):
            continue
        sections = {n for m in SECTION.finditer(text) for n in m.groups() if n}
        for m in QUOTED.finditer(text):
            number = m.group()
            if number not in shown and number not in allowed and number not in sections:
                found.append((i, number))
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_number_the_prose_quotes_is_one_the_notebook_printed(path):
    assert not unmeasured_numbers(json.loads(path.read_text()), NOT_MEASURED.get(path.stem, {}))


def test_the_number_check_catches_a_figure_no_cell_printed():
    nb = {"cells": [{"cell_type": "code", "source": ["print(0.83)"], "outputs": [{"text": "0.83\n"}]},
                    {"cell_type": "markdown", "source": ["The rate is 0.83, up 12% from 0.74 (section 3.2)."]},
                    {"cell_type": "markdown", "source": ["## References\n\nA paper's 0.99."]}]}
    assert unmeasured_numbers(nb, {}) == [(1, "12%"), (1, "0.74")]
    assert unmeasured_numbers(nb, {"12%": "given", "0.74": "given"}) == []
