"""Insert (or refresh) the "Build it yourself" section of each chapter notebook.

    python tools/add_lab_sections.py [notebooks/01_block.ipynb ...]    (default: every NN_*.ipynb)

For each notebook ``NN_*.ipynb`` whose chapter has labs in ``course_pkg.labs`` it writes, just
before the chapter's "Summary" heading cell, one section with those labs: per lab, what to write, the stub,
the grader run on the stub (its committed output lists what is checked) and the package's code
as the solution, collapsed. Every cell it writes carries the tag ``lab`` in its metadata, and
only such cells are ever removed or replaced: the script touches no other cell. Run it again
and it changes nothing while the section is up to date (outputs kept); when a lab changed, the
old section is replaced and the notebook must be re-executed (tools/execute_notebooks.py),
which the script reminds you of.
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


def _lab_cells(chapter: int) -> list[nbformat.NotebookNode]:
    labs = labs_of_chapter(chapter)
    if not labs:
        return []
    cells = [_markdown(INTRO.format(first=labs[0].name), "intro", chapter)]
    for i, lab in enumerate(labs):
        module, _, stub = lab.stub_path.partition(":")
        imports = "from course_pkg.labs import grade, show_solution, show_stub\n" if i == 0 else ""
        cells += [
            _markdown(f"### Lab `{lab.name}`: {lab.title}\n\n**Write:** {lab.task}\n\n"
                      f"**The grader checks:** {lab.checks}.", f"{lab.name}-task", chapter),
            _code(f'{imports}show_stub("{lab.name}")', f"{lab.name}-stub", chapter),
            _code(f"from {module} import {stub}\n\n"
                  f"# The stub as it is fails; grade your own version the same way.\n"
                  f'grade("{lab.name}", {stub})', f"{lab.name}-grade", chapter),
            _code(f'show_solution("{lab.name}")', f"{lab.name}-solution", chapter),
        ]
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
    """Bring ``path``'s lab section up to date; True if the file changed."""
    match = re.match(r"(\d\d)_", path.name)
    if not match:
        raise SystemExit(f"{path}: not a chapter notebook (NN_name.ipynb)")
    nb = nbformat.read(path, as_version=4)
    new = _lab_cells(int(match.group(1)))
    others = [c for c in nb.cells if not _is_lab_cell(c)]
    at = _summary_index(others)
    if new and at < 0:
        raise SystemExit(f"{path}: no markdown cell with a 'Summary' heading; nothing changed")
    current = [c for c in nb.cells if _is_lab_cell(c)]
    in_place = nb.cells == others[:at] + current + others[at:] if new else not current
    if in_place and [(c.cell_type, c.source) for c in current] == [(c.cell_type, c.source) for c in new]:
        return False
    nb.cells = others[:at] + new + others[at:] if new else others
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
