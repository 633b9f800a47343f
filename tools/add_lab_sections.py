"""Insert (or refresh) the "Build it yourself" sections of each chapter notebook.

    python tools/add_lab_sections.py [notebooks/01_block.ipynb ...]    (default: every NN_*.ipynb)

For each notebook ``NN_*.ipynb`` whose chapter has labs in ``course_pkg.labs`` it writes, per lab,
what to write, the stub, the grader run on the stub (its committed output lists what is checked)
and the package's code as the solution, collapsed. A lab goes just before the cell tagged
``reveals-<lab name>`` -- the first cell that shows the body the lab asks for, so the reader
writes it before reading it ("build first") -- or, in a chapter without that tag, just before
the chapter's "Summary" heading cell. The first lab of a chapter is preceded by an intro cell.

Every cell it writes carries the tag ``lab`` in its metadata, and only such cells are ever removed
or replaced: the script touches no other cell. Run it again and it changes nothing while the
sections are up to date (outputs kept); when a lab changed, the old sections are replaced and
the notebook must be re-executed (tools/execute_notebooks.py), which the script reminds you of.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from course_pkg.labs import labs_of_chapter  # noqa: E402

TAG = "lab"
SUMMARY = re.compile(r"^#{1,6}\s*summary\b", re.IGNORECASE | re.MULTILINE)

INTRO = """## Build it yourself

Each lab below leaves out a body this chapter built. Copy the stub into a new cell (or a file),
replace every `...`, run it, and grade your version, e.g. `grade("{first}", YourClass)`: the
report lists each scenario your code fails and what differed. The cells below grade the stub
itself, so you can see what is checked; the solution -- the package's own code -- is folded
under it.

In a classroom, grade a file from a shell: `python -m course_pkg.labs list` shows every lab,
`python -m course_pkg.labs {first} my_solution.py` grades one (exit status 1 on failure)."""


INTRO_BUILD_FIRST = """## Build it yourself

Write the code this chapter is about before you read it: the package's own version follows each
lab, folded first, then shown and used. Copy the stub into a new cell (or a file), replace every
`...`, run it, and grade your version, e.g. `grade("{first}", YourClass)`: the report lists each
scenario your code fails and what differed. The cells below grade the stub itself, so you can
see what is checked.{later}

In a classroom, grade a file from a shell: `python -m course_pkg.labs list` shows every lab,
`python -m course_pkg.labs {first} my_solution.py` grades one in a child process with time
limits (exit status 0 only when it passes; `--json` for an autograder)."""

#: The tag that marks the first cell showing a lab's body: the lab's section goes just before it.
REVEALS = "reveals-{}"


def _lab_group(lab, first: bool) -> list[nbformat.NotebookNode]:
    """The cells of one lab (the import line with the chapter's first lab)."""
    module, _, stub = lab.stub_path.partition(":")
    imports = "from course_pkg.labs import grade, show_solution, show_stub\n" if first else ""
    chapter = lab.chapter
    return [
        _markdown(f"### Lab `{lab.name}`: {lab.title}\n\n**Write:** {lab.task}\n\n"
                  f"**The grader checks:** {lab.checks}.", f"{lab.name}-task", chapter),
        _code(f'{imports}show_stub("{lab.name}")', f"{lab.name}-stub", chapter),
        _code(f"from {module} import {stub}\n\n"
              f"# The stub as it is fails; grade your own version the same way.\n"
              f'grade("{lab.name}", {stub})', f"{lab.name}-grade", chapter),
        _code(f'show_solution("{lab.name}")', f"{lab.name}-solution", chapter),
    ]


def _placed(chapter: int, others: list, path: Path) -> list:
    """``others`` (the notebook's cells that are no lab cells) with the chapter's lab sections in place."""
    labs = labs_of_chapter(chapter)
    if not labs:
        return list(others)
    summary = _summary_index(others)
    anchors = {}
    for lab in labs:
        tagged = [i for i, c in enumerate(others) if REVEALS.format(lab.name) in c.get("metadata", {}).get("tags", [])]
        anchors[lab.name] = tagged[0] if tagged else summary
    if min(anchors.values()) < 0:
        raise SystemExit(f"{path}: no markdown cell with a 'Summary' heading; nothing changed")
    ordered = sorted(labs, key=lambda lab: anchors[lab.name])      # stable: registry order at one anchor
    first = ordered[0]
    if anchors[first.name] == summary:
        intro = INTRO.format(first=first.name)
    else:
        later = [f"`{lab.name}`" for lab in ordered[1:]]
        intro = INTRO_BUILD_FIRST.format(first=first.name, later=(
            f" This chapter's other lab{'s' if len(later) > 1 else ''} ({', '.join(later)}) "
            f"come{'' if len(later) > 1 else 's'} later in the chapter." if later else ""))
    cells = []
    for i, cell in enumerate(others):
        for lab in ordered:
            if anchors[lab.name] == i:
                if lab is first:
                    cells.append(_markdown(intro, "intro", chapter))
                cells += _lab_group(lab, lab is first)
        cells.append(cell)
    return cells


def _cell_id(part: str, chapter: int) -> str:
    return f"lab-{chapter:02d}-{part}".replace("_", "-")


def _markdown(source: str, part: str, chapter: int) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_markdown_cell(source, metadata={"tags": [TAG]})
    cell.id = _cell_id(part, chapter)
    return cell


def _code(source: str, part: str, chapter: int) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": [TAG]})
    cell.id = _cell_id(part, chapter)
    return cell


def _is_lab_cell(cell) -> bool:
    return TAG in cell.get("metadata", {}).get("tags", [])


def _summary_index(cells) -> int:
    for i, cell in enumerate(cells):
        if cell.cell_type == "markdown" and not _is_lab_cell(cell) and SUMMARY.search(cell.source):
            return i
    return -1


def update(path: Path) -> bool:
    """Bring ``path``'s lab sections up to date; True if the file changed."""
    match = re.match(r"(\d\d)_", path.name)
    if not match:
        raise SystemExit(f"{path}: not a chapter notebook (NN_name.ipynb)")
    nb = nbformat.read(path, as_version=4)
    others = [c for c in nb.cells if not _is_lab_cell(c)]
    cells = _placed(int(match.group(1)), others, path)
    if [(c.cell_type, c.source, c.get("id")) for c in cells] == [(c.cell_type, c.source, c.get("id")) for c in nb.cells]:
        return False
    nb.cells = cells
    nbformat.write(nb, path)
    return True


def main(paths: list[str]) -> int:
    targets = [Path(p) for p in paths] or sorted(p.relative_to(Path.cwd()) if p.is_relative_to(Path.cwd()) else p
                                                 for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    changed = [p for p in targets if update(p)]
    for p in changed:
        print(f"{p}: lab section written")
    if changed:
        print("re-execute them: python tools/execute_notebooks.py " + " ".join(str(p) for p in changed))
    else:
        print("every lab section is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
