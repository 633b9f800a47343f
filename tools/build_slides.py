"""Export every chapter as reveal.js lecture slides: ``make slides`` -> build/slides/.

    python tools/build_slides.py                      # every notebooks/NN_*.ipynb
    python tools/build_slides.py notebooks/02_block_manager.ipynb --out build/slides
    python tools/build_slides.py --no-vendor          # decks only, no npm (the smoke test does this)

The notebooks are never edited: slide types are decided here, at export time, on a copy.

Slide rules (a cell that already has ``metadata.slideshow.slide_type`` keeps it; the rules
only fill in the cells that have none):

0. A markdown cell with a ``#``, ``##`` or ``###`` heading below its first line is first cut
   in two before that heading (on the copy; the words are unchanged), so that a heading at
   the end of a paragraph still opens its own slide.
1. A markdown cell whose first line is a ``# `` or ``## `` heading starts a **slide**.
2. A markdown cell that opens an exercise is a **fragment**, so the exercises of a slide
   appear one press at a time (the code cells after it stay in that fragment). It opens an
   exercise when its first line starts with "Exercise" (as a heading, in bold or plain), or,
   under a ``#``/``##`` heading that mentions exercises, with a number: ``**2.**``, ``2.``.
3. A markdown cell whose first line is a ``### `` heading starts a **sub-slide**.
4. A code cell starts a **sub-slide** when the current slide or sub-slide already shows a
   code cell and this one would take it past ``SLIDE_LINES`` lines (source, text output, and
   ``FIGURE_LINES`` per figure: so two figures never share a slide). The split moves up to the
   plain prose cells right above it, which introduce it; it never separates a code cell from
   the exercise prompt right above it.
5. Everything else (``-``) continues the current slide; a slide too long for the screen
   scrolls.

The notebook passes run inside nbconvert as ``Preprocessor`` s, before the reveal template's
own: ``EmbedLocalImages``, ``SplitAtHeadings`` (rule 0) and ``MarkSlides`` (rules 1-5). Each
wraps a plain function of the same job (``embed_local_images``, ``split_at_headings``,
``mark_slides``) that returns a new notebook and leaves its argument unchanged.

Self-contained decks: figures are PNG outputs, which nbconvert writes into the HTML as
``data:`` URIs; markdown images that are files of the course (e.g. ../figures/*.png) are
embedded as ``data:`` URIs too. The widgets' saved state (stored by
tools/execute_notebooks.py) is written into each deck and rendered by the Jupyter widgets
HTML manager. reveal.js, require.js, jQuery, MathJax and the widgets HTML manager are not loaded from a
CDN: ``vendor()`` fetches pinned versions once with ``npm pack`` (npm's own cache makes later
builds work offline) into ``<out>/_vendor/``, and every deck points there by relative URL, so
the folder can be opened from disk or served by any static server. MathJax (for LaTeX in prose)
is vendored the same way, and the template drops nbconvert's mermaid.js import: a deck
opened from disk makes no request off the machine.
"""
from __future__ import annotations

import argparse
import base64
import copy
import html
import json
import mimetypes
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import nbformat
from nbconvert.preprocessors import Preprocessor
from traitlets import Unicode

REPO = Path(__file__).resolve().parents[1]

# npm package spec -> (folder under _vendor/, paths inside the package to keep, paths to drop).
# reveal.js 4.0.2 is the version nbconvert's reveal template is written for (it loads
# dist/reveal.js with require.js and plugin/notes/notes.js); html-manager 1.x renders
# ipywidgets 8 state; MathJax 2 is what nbconvert's templates configure.
VENDOR = {
    "reveal.js@4.0.2": ("reveal.js", ("dist/", "plugin/notes/", "LICENSE"), ()),
    "requirejs@2.3.7": ("requirejs", ("require.js", "package.json"), ()),
    "jquery@3.7.1": ("jquery", ("dist/jquery.min.js", "LICENSE.txt"), ()),
    "@jupyter-widgets/html-manager@1.0.15": ("html-manager", ("dist/", "LICENSE"),
                                             ("dist/embed.js", "dist/libembed-amd.js")),
    "mathjax@2.7.9": ("mathjax", ("MathJax.js", "LICENSE", "config/TeX-AMS_CHTML-full.js", "config/Safe.js",
                                  "extensions/", "jax/output/CommonHTML/", "jax/input/TeX/", "jax/element/",
                                  "fonts/HTML-CSS/TeX/woff/", "localization/en/"), ()),
}
VENDOR_DIR = "_vendor"
VENDOR_STAMP = ".vendored.json"
# The widget manager's bundle asks for its icon fonts (Font Awesome) relative to the page, at
# these folders; copies of its web fonts go there so the buttons show their icons.
WIDGET_FONT_DIRS = ("@jupyter-widgets", "@jupyter-widgets/html-manager/dist")

EXPORTER_CONFIG = {
    "reveal_url_prefix": f"{VENDOR_DIR}/reveal.js",
    "require_js_url": f"{VENDOR_DIR}/requirejs/require.js",
    "jquery_url": f"{VENDOR_DIR}/jquery/dist/jquery.min.js",
    "widget_renderer_url": f"{VENDOR_DIR}/html-manager/dist/embed-amd.js",
    "mathjax_url": f"{VENDOR_DIR}/mathjax/MathJax.js?config=TeX-AMS_CHTML-full,Safe",
    "template_file": "course_slides.html.j2",
    "reveal_theme": "white",
    "reveal_transition": "none",
    "reveal_scroll": True,
    "reveal_number": "c/t",
    "embed_images": True,
    "exclude_input_prompt": True,
    "exclude_output_prompt": True,
}

# nbconvert's reveal template, less the mermaid.js import (from a CDN; the course draws no
# mermaid diagrams), so that opening a deck makes no request off the machine.
TEMPLATE = {
    "course_slides.html.j2": "{%- extends 'index.html.j2' -%}\n"
                             "{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}\n",
}

_HEADING = re.compile(r"^(#{1,6})\s")
_EXERCISE = re.compile(r"^\s*(?:#{1,6}\s*)?(?:\*\*|__)?\s*exercise\b", re.IGNORECASE)
_NUMBERED = re.compile(r"^\s*(?:\*\*|__)?\s*\d+[.)]")

SLIDE_LINES = 26      # about what a 960x700 reveal slide shows at the template's font sizes
FIGURE_LINES = 18     # a figure counts as this many lines
WRAP = 90             # characters per line before a long line counts as two


def _first_line(cell) -> str:
    for line in cell.source.splitlines():
        if line.strip():
            return line
    return ""


def _heading_level(cell) -> int:
    """1..6 for a markdown cell that opens with a heading, else 0."""
    if cell.cell_type != "markdown":
        return 0
    match = _HEADING.match(_first_line(cell))
    return len(match.group(1)) if match else 0


def is_exercise(cell, in_exercise_section: bool = False) -> bool:
    if cell.cell_type != "markdown":
        return False
    first = _first_line(cell)
    return bool(_EXERCISE.match(first)) or (in_exercise_section and bool(_NUMBERED.match(first)))


def has_figure(cell) -> bool:
    return cell.cell_type == "code" and any(
        "image/png" in out.get("data", {}) or "image/svg+xml" in out.get("data", {})
        for out in cell.get("outputs", []))


def _text_lines(text: str) -> int:
    return sum(1 + len(line) // WRAP for line in text.splitlines())


def cell_lines(cell) -> int:
    """Rough height of a cell on a slide, in lines (see SLIDE_LINES)."""
    lines = _text_lines(cell.source)
    for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
        data = out.get("data", {})
        if "image/png" in data or "image/svg+xml" in data:
            lines += FIGURE_LINES
        elif out.get("output_type") == "stream":
            lines += _text_lines(out.get("text", ""))
        elif "text/plain" in data:
            lines += _text_lines(data["text/plain"])
    return lines


def explicit_slide_type(cell) -> str | None:
    slideshow = cell.metadata.get("slideshow")
    if isinstance(slideshow, dict) and slideshow.get("slide_type"):
        return slideshow["slide_type"]
    return None


def slide_types(nb) -> list[str]:
    """The slide type of each cell by the module's rules (explicit metadata wins)."""
    cells = nb.cells
    explicit = [explicit_slide_type(cell) for cell in cells]
    types: list[str] = []
    in_exercises = False
    section: list[int] = []          # indices of the cells of the current slide / sub-slide
    for index, cell in enumerate(cells):
        level = _heading_level(cell)
        if level in (1, 2):
            in_exercises = "exercise" in _first_line(cell).lower()
        if explicit[index]:
            kind = explicit[index]
        elif level in (1, 2):
            kind = "slide"
        elif is_exercise(cell, in_exercises):
            kind = "fragment"
        elif level == 3:
            kind = "subslide"
        else:
            kind = "-"
        if kind in ("slide", "subslide"):
            section = []
        elif (kind == "-" and not explicit[index] and cell.cell_type == "code"
              and any(cells[i].cell_type == "code" for i in section)
              and sum(cell_lines(cells[i]) for i in section) + cell_lines(cell) > SLIDE_LINES):
            # Rule 4: split, moving up over the plain prose that introduces this cell.
            start = index
            while (start - 1 >= 0 and types[start - 1] == "-" and not explicit[start - 1]
                   and cells[start - 1].cell_type == "markdown" and start - 1 in section):
                start -= 1
            if start == index and index > 0 and types[index - 1] == "fragment":
                pass  # an exercise's prompt right above: keep the code with it
            elif start < index:
                types[start] = "subslide"
                section = list(range(start, index))
            else:
                kind = "subslide"
                section = []
        types.append(kind)
        section.append(index)
    return types


_FENCE = re.compile(r"^\s*(```|~~~)")


def split_at_headings(nb):
    """A copy of ``nb`` where markdown cells are cut before each heading (levels 1-3) that is
    not their first line; headings inside fenced code blocks are left alone. The first piece
    keeps the cell's metadata; the others start with none, so the rules decide their type."""
    out = copy.deepcopy(nb)
    cells = []
    for cell in out.cells:
        if cell.cell_type != "markdown":
            cells.append(cell)
            continue
        pieces, current, in_fence = [], [], False
        for line in cell.source.splitlines(keepends=True):
            if _FENCE.match(line):
                in_fence = not in_fence
            if (not in_fence and re.match(r"^#{1,3}\s", line)
                    and any(l.strip() for l in current)):
                pieces.append("".join(current))
                current = []
            current.append(line)
        pieces.append("".join(current))
        for k, text in enumerate(pieces):
            piece = copy.deepcopy(cell) if k == 0 else nbformat.v4.new_markdown_cell()
            piece.source = text.rstrip("\n") if k < len(pieces) - 1 else text
            if k:
                if "attachments" in cell:
                    piece.attachments = copy.deepcopy(cell.attachments)
                if "id" in cell:
                    piece.id = f"{cell.id}-{k}"
            cells.append(piece)
    out.cells = cells
    return out


def mark_slides(nb):
    """A copy of ``nb`` with ``metadata.slideshow.slide_type`` set on every cell."""
    marked = copy.deepcopy(nb)
    for cell, kind in zip(marked.cells, slide_types(nb)):
        cell.metadata.setdefault("slideshow", {})["slide_type"] = kind
    return marked


_MD_IMAGE = re.compile(r"(!\[[^\]]*\]\()([^)\s]+)(\))")
_HTML_IMAGE = re.compile(r"(<img\b[^>]*\bsrc=[\"'])([^\"']+)([\"'])")


def embed_local_images(nb, notebook_dir: Path, allowed_root: Path):
    """A copy of ``nb`` whose markdown images that are local files become ``data:`` URIs.

    nbconvert embeds only images inside the notebook's own folder; the chapters also show
    figures from ../figures/. Files outside ``allowed_root`` and remote URLs are left alone.
    """
    root = allowed_root.resolve()

    def to_data_uri(match):
        src = match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", src, re.IGNORECASE):
            return match.group(0)  # http:, data:, attachment: ...
        path = (notebook_dir / src).resolve()
        if not path.is_file() or not path.is_relative_to(root):
            return match.group(0)
        mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        return f"{match.group(1)}data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}{match.group(3)}"

    embedded = copy.deepcopy(nb)
    for cell in embedded.cells:
        if cell.cell_type == "markdown":
            cell.source = _HTML_IMAGE.sub(to_data_uri, _MD_IMAGE.sub(to_data_uri, cell.source))
    return embedded


class EmbedLocalImages(Preprocessor):
    """nbconvert pass: markdown images that are files under ``root`` become ``data:`` URIs
    (``embed_local_images``; the notebook's folder comes from ``resources["metadata"]["path"]``)."""

    root = Unicode("", help="only files under this folder are embedded (default: the "
                            "notebook folder's parent)").tag(config=True)

    def preprocess(self, nb, resources):
        notebook_dir = Path(resources["metadata"]["path"])
        root = Path(self.root) if self.root else notebook_dir.parent
        return embed_local_images(nb, notebook_dir, root), resources


class SplitAtHeadings(Preprocessor):
    """nbconvert pass: rule 0, a markdown cell is cut before each inner heading."""

    def preprocess(self, nb, resources):
        return split_at_headings(nb), resources


class MarkSlides(Preprocessor):
    """nbconvert pass: rules 1-5, every cell gets ``metadata.slideshow.slide_type``."""

    def preprocess(self, nb, resources):
        return mark_slides(nb), resources


# In this order, before the reveal template's own passes (which read slide_type).
SLIDE_PREPROCESSORS = [EmbedLocalImages, SplitAtHeadings, MarkSlides]


def slides_exporter(root: Path):
    """nbconvert's SlidesExporter with the course's template, settings and notebook passes;
    local images are embedded only from files under ``root``."""
    from jinja2 import DictLoader
    from nbconvert import SlidesExporter
    from traitlets.config import Config

    config = Config({"SlidesExporter": {**EXPORTER_CONFIG, "preprocessors": SLIDE_PREPROCESSORS},
                     "EmbedLocalImages": {"root": str(root)}})
    return SlidesExporter(config=config, extra_loaders=[DictLoader(TEMPLATE)])


def export_deck(notebook: Path, out_dir: Path) -> Path:
    """Write ``<out_dir>/<notebook stem>.slides.html`` and return its path."""
    exporter = slides_exporter(notebook.parent.parent)
    nb = nbformat.read(notebook, as_version=4)
    body, _ = exporter.from_notebook_node(
        nb, resources={"metadata": {"name": notebook.stem, "path": str(notebook.parent)}})
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{notebook.stem}.slides.html"
    target.write_text(body, encoding="utf-8")
    return target


def vendor(out_dir: Path, npm: str = "npm") -> Path:
    """Fetch the pinned front-end packages with ``npm pack`` into ``<out_dir>/_vendor/``.

    Does nothing when the folder already holds exactly these versions. Raises RuntimeError
    (naming the package) when npm is missing or cannot fetch.
    """
    target = out_dir / VENDOR_DIR
    stamp = target / VENDOR_STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == sorted(VENDOR):
        return target
    npm_path = shutil.which(npm)
    if npm_path is None:
        raise RuntimeError(f"npm not found: it is needed once to fetch {', '.join(VENDOR)} "
                           "(or build with --no-vendor and serve those files yourself)")
    shutil.rmtree(target, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        for spec, (folder, keep, drop) in VENDOR.items():
            result = subprocess.run([npm_path, "pack", spec, "--silent", "--pack-destination", tmp],
                                    capture_output=True, text=True, timeout=300)
            tgz = Path(tmp) / result.stdout.strip().splitlines()[-1] if result.stdout.strip() else None
            if result.returncode != 0 or tgz is None or not tgz.exists():
                raise RuntimeError(f"npm pack {spec} failed: {result.stderr.strip()[-500:]}")
            with tarfile.open(tgz) as tar:
                # npm packs everything under "package/"; keep the listed files, without that prefix.
                members = []
                for member in tar.getmembers():
                    rel = member.name.split("/", 1)[1] if "/" in member.name else ""
                    if member.isfile() and rel.startswith(keep) and rel not in drop and not rel.endswith(".map"):
                        members.append(member.replace(name=rel, deep=False))
                try:
                    # The "data" filter refuses absolute paths, paths that leave the folder,
                    # links and device files, and drops permission bits we do not want.
                    tar.extractall(target / folder, members=members, filter="data")
                except tarfile.FilterError as exc:
                    shutil.rmtree(target, ignore_errors=True)
                    raise RuntimeError(f"npm pack {spec}: refusing to unpack {exc.tarinfo.name!r} ({exc})") from exc
    for folder in WIDGET_FONT_DIRS:
        shutil.rmtree(out_dir / folder, ignore_errors=True)
        (out_dir / folder).mkdir(parents=True)
        for font in (target / "html-manager" / "dist").glob("*.woff*"):
            shutil.copy2(font, out_dir / folder / font.name)
    stamp.write_text(json.dumps(sorted(VENDOR)))
    return target


def write_index(out_dir: Path) -> Path:
    """index.html linking every deck in ``out_dir`` (also those of earlier partial builds)."""
    decks = sorted(out_dir.glob("*.slides.html"))
    items = "\n".join(f'  <li><a href="{html.escape(d.name)}">{html.escape(d.stem.removesuffix(".slides"))}</a></li>'
                      for d in decks)
    index = out_dir / "index.html"
    index.write_text(f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                     f"<title>Lecture slides</title></head>\n<body>\n<h1>Lecture slides</h1>\n"
                     f"<ul>\n{items}\n</ul>\n</body></html>\n", encoding="utf-8")
    return index


def build(notebooks: list[Path], out_dir: Path, with_vendor: bool = True) -> list[Path]:
    if not notebooks:
        raise ValueError("no notebooks to export")
    missing = [str(n) for n in notebooks if not n.is_file()]
    if missing:
        raise FileNotFoundError(f"notebooks not found: {', '.join(missing)}")
    if with_vendor:
        vendor(out_dir)
    decks = [export_deck(n, out_dir) for n in notebooks]
    write_index(out_dir)
    return decks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="notebooks to export (default: notebooks/[0-9][0-9]_*.ipynb)")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "slides")
    parser.add_argument("--no-vendor", action="store_true",
                        help="do not fetch reveal.js & co. with npm (decks then need them served)")
    args = parser.parse_args(argv)
    notebooks = args.notebooks or sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    for deck in build(notebooks, args.out, with_vendor=not args.no_vendor):
        print(f"wrote {deck.relative_to(args.out.parent) if deck.is_relative_to(args.out.parent) else deck}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
