"""Lecture slides: the slide rules of tools/build_slides.py, and a deck per chapter.

The decks are built here without the npm step (``with_vendor=False``), so this runs offline;
tests/browser/test_browser_slides.py opens a fully vendored deck in Chromium.
"""
from __future__ import annotations

import base64
import copy
import json
import re
import sys
from pathlib import Path

import nbformat
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import load_build_slides

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


bs = load_build_slides()
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n fake image bytes").decode()


def md(text, **meta):
    cell = nbformat.v4.new_markdown_cell(text)
    cell.metadata.update(meta)
    return cell


def code(text="x = 1", figure=False, lines_out=0, **meta):
    cell = nbformat.v4.new_code_cell(text)
    cell.metadata.update(meta)
    if lines_out:
        cell.outputs.append(nbformat.v4.new_output("stream", name="stdout",
                                                   text="".join(f"line {i}\n" for i in range(lines_out))))
    if figure:
        cell.outputs.append(nbformat.v4.new_output("display_data", data={"image/png": PNG,
                                                                         "text/plain": "<Figure>"}))
    return cell


def notebook(*cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = list(cells)
    return nb


# --- the rules -------------------------------------------------------------------------------

def test_rules_on_a_made_up_chapter():
    nb = notebook(
        md("# 09 · A chapter\n\nGoals."),                 # 1: slide
        code("import x"),                                   # -
        md("## 1. Step by step"),                           # 1: slide
        md("First we draw the start."),                     # -
        code("show(a)", figure=True),                       # - (first figure here)
        md("Then the next state."),                         # 4: the split moves up to this prose
        code("show(b)", figure=True),                       # -
        md("### A detail"),                                 # 3: sub-slide
        code("print(1)"),                                   # -
        md("## Exercises\n\nReplace each `...`."),          # 1: slide
        code("answer = ..."),                               # -
        md("**2.** The next one."),                         # 2: numbered, under an exercises heading
        code("answer = ..."),                               # -
        md("### Exercise 3\nA third."),                     # 2 wins over 3: fragment
        code("answer = ..."),                               # -
        md("## Summary\n\n**1.** not an exercise here"),    # 1: slide
        md("**2.** a numbered list item, not an exercise"),  # - (no exercises heading above)
    )
    assert bs.slide_types(nb) == [
        "slide", "-", "slide", "-", "-", "subslide", "-", "subslide", "-",
        "slide", "-", "fragment", "-", "fragment", "-", "slide", "-"]


def test_explicit_slideshow_metadata_wins_and_the_notebook_is_not_changed():
    nb = notebook(
        md("# Title"),
        md("## Would be a slide", slideshow={"slide_type": "skip"}),
        code("show(a)", figure=True),
        code("show(b)", figure=True, slideshow={"slide_type": "-"}),   # rule 4 must not override
        md("plain prose", slideshow={"slide_type": "notes"}),
        code("show(c)", figure=True),
    )
    before = copy.deepcopy(nb)
    marked = bs.mark_slides(nb)
    assert nb == before
    types = [c.metadata["slideshow"]["slide_type"] for c in marked.cells]
    # The last figure may not pull the explicit notes cell above it along: it starts a sub-slide.
    assert types == ["slide", "skip", "-", "-", "notes", "subslide"]


def test_a_heading_inside_a_cell_gets_a_cell_and_a_slide_of_its_own():
    cell = md("Closing words of section 1.\n\n## 2. Next section\n\nIts text.\n"
              "```python\n# a comment, not a heading\n```\n### A detail\nMore.",
              slideshow={"slide_type": "-"})
    cell.id = "abc"
    nb = notebook(md("# Title"), cell)
    before = copy.deepcopy(nb)
    split = bs.split_at_headings(nb)
    assert nb == before
    assert [c.source for c in split.cells] == [
        "# Title", "Closing words of section 1.",
        "## 2. Next section\n\nIts text.\n```python\n# a comment, not a heading\n```",
        "### A detail\nMore."]
    assert " ".join(c.source for c in split.cells[1:]).split() == cell.source.split()  # same words
    assert split.cells[1].metadata == cell.metadata and split.cells[2].metadata == {}
    assert [c.id for c in split.cells[1:]] == ["abc", "abc-1", "abc-2"]
    assert bs.slide_types(split) == ["slide", "-", "slide", "subslide"]


def test_a_long_demo_is_split_but_a_short_one_is_not():
    short = notebook(md("## S"), code("a"), code("b"), code("c"))
    assert bs.slide_types(short) == ["slide", "-", "-", "-"]
    long = notebook(md("## L"), code("a", lines_out=20), md("Now more."), code("b", lines_out=20))
    assert bs.slide_types(long) == ["slide", "-", "subslide", "-"]
    # A code cell right under an exercise's prompt stays with it, however long.
    exercise = notebook(md("## Exercises"), code("a", lines_out=20), md("**2.** Next"), code("b", lines_out=40))
    assert bs.slide_types(exercise) == ["slide", "-", "fragment", "-"]


_cell = st.one_of(
    st.builds(lambda level, word: md("#" * level + " " + word), st.integers(1, 3),
              st.sampled_from(["Intro", "Exercises", "Exercise 4", "Summary"])),
    st.builds(md, st.sampled_from(["Some prose.", "**3.** numbered", "Exercise: try it", "- a list"])),
    st.builds(code, st.just("x"), st.booleans(), st.integers(0, 30)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_cell, min_size=1, max_size=25))
def test_rule_invariants(cells):
    nb = notebook(*cells)
    before = copy.deepcopy(nb)
    types = bs.slide_types(nb)
    assert nb == before and len(types) == len(cells)
    assert set(types) <= {"slide", "subslide", "fragment", "-"}
    exercises = False
    for cell, kind in zip(cells, types):
        level = bs._heading_level(cell)
        if level in (1, 2):
            assert kind == "slide"
            exercises = exercises or "exercise" in cell.source.lower()
        elif level == 3 and not bs.is_exercise(cell):
            assert kind == "subslide"
        if kind == "fragment":
            assert bs.is_exercise(cell, True)
    # Without exercises (whose cells stay with their prompt), no slide shows two figures.
    if not exercises and not any(bs.is_exercise(c) for c in cells):
        figures = 0
        for cell, kind in zip(cells, types):
            if kind in ("slide", "subslide"):
                figures = 0
            figures += bs.has_figure(cell)
            assert figures <= 1


# --- the decks ---------------------------------------------------------------------------------

def test_there_are_chapters_to_export():
    assert CHAPTERS, "no notebooks/NN_*.ipynb found"


#: Checked by ``make test``: a chapter with steppers (widget state) and one with exercises and
#: many figures. Every chapter is checked by ``make test-all`` (marked slow: 40 s for all of them).
DECK_SAMPLE = ("02_block_manager", "11_real_traces")


@pytest.fixture(scope="module")
def sample_decks(tmp_path_factory):
    """The decks of ``DECK_SAMPLE``, built by one call (with their index page)."""
    out = tmp_path_factory.mktemp("slides")
    return {deck.name: deck for deck in bs.build([c for c in CHAPTERS if c.stem in DECK_SAMPLE], out,
                                                 with_vendor=False)}


@pytest.fixture(scope="module")
def deck_of(sample_decks, tmp_path_factory):
    """A chapter's deck: a sample one, or one built when a test asks for it (about 3 s a chapter)."""
    out = tmp_path_factory.mktemp("more-slides")

    def build(chapter: Path) -> Path:
        if f"{chapter.stem}.slides.html" in sample_decks:
            return sample_decks[f"{chapter.stem}.slides.html"]
        [deck] = bs.build([chapter], out, with_vendor=False)
        return deck
    return build


@pytest.mark.parametrize("chapter", [c if c.stem in DECK_SAMPLE else pytest.param(c, marks=pytest.mark.slow)
                                     for c in CHAPTERS], ids=lambda p: p.stem)
def test_each_chapter_has_a_self_contained_deck_with_its_figures(deck_of, chapter):
    deck = deck_of(chapter)
    page = deck.read_text(encoding="utf-8")
    nb = nbformat.read(chapter, as_version=4)

    # Every figure of the chapter is in the deck, as a data: URI (no file, no CDN).
    pngs = [out["data"]["image/png"] for cell in nb.cells if cell.cell_type == "code"
            for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
    assert pngs, f"{chapter.name} draws no figure"
    for png in pngs:
        assert f"data:image/png;base64,{''.join(png.split())}" in page
    assert not re.search(r"<img[^>]+src=\"(?!data:)", page), "an <img> does not use a data: URI"

    # No script or stylesheet from another host; reveal.js & co. come from _vendor/.
    remote = re.findall(r"<(?:script|link)\b[^>]*(?:src|href)=\"((?:https?:)?//[^\"]+)\"", page)
    assert remote == []
    for key in ("require_js_url", "jquery_url", "mathjax_url"):
        assert f'src="{bs.EXPORTER_CONFIG[key]}"' in page
    prefix = bs.EXPORTER_CONFIG["reveal_url_prefix"]
    assert f'href="{prefix}/dist/reveal.css"' in page and f'"{prefix}/dist/reveal.js"' in page

    # The widgets' saved state travels with the deck, with every widget view it shows.
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json")
    views = [out["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]
             for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
             if "application/vnd.jupyter.widget-view+json" in out.get("data", {})]
    if views:
        assert state, f"{chapter.name} shows widgets but saved no widget state"
        assert bs.EXPORTER_CONFIG["widget_renderer_url"] in page
        embedded = re.search(r'<script type="application/vnd.jupyter.widget-state\+json">(.*?)</script>',
                             page, re.S)
        assert embedded, "the deck carries no widget state"
        models = json.loads(embedded.group(1))["state"]
        assert all(model_id in models for model_id in views)

    # The deck's structure, against an oracle read off the notebook's text (not the rules'
    # code): a top-level <section> per # or ## heading line, at least one nested <section>
    # more per ### heading line, and a fragment per exercise prompt of an exercises section.
    headings = heading_levels(nb)
    outer, inner = section_depths(page)
    assert outer == headings.count(1) + headings.count(2) >= 2
    assert inner >= outer + headings.count(3)
    assert page.count('class="fragment"') == exercise_prompts(nb) >= 1


def heading_levels(nb) -> list[int]:
    """The level of every markdown heading line, outside fenced code."""
    levels = []
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        fenced = False
        for line in cell.source.splitlines():
            if re.match(r"^\s*(```|~~~)", line):
                fenced = not fenced
            elif not fenced and (m := re.match(r"^(#{1,3})\s", line)):
                levels.append(len(m.group(1)))
    return levels


def exercise_prompts(nb) -> int:
    """Markdown cells that start with a bold number ("**N.**", "**N. (code)**") inside a
    "## ...Exercises..." section."""
    count, in_exercises = 0, False
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        for line in cell.source.splitlines():
            if re.match(r"^#{1,2}\s", line):
                in_exercises = "exercise" in line.lower()
        count += in_exercises and bool(re.match(r"^\*\*\d+\.", cell.source.lstrip()))
    return count


def section_depths(page: str) -> tuple[int, int]:
    """(top-level <section>s, <section>s nested one level) in the deck's reveal container."""
    from html.parser import HTMLParser

    class Sections(HTMLParser):
        def __init__(self):
            super().__init__()
            self.depth, self.counts = 0, [0, 0, 0]

        def handle_starttag(self, tag, attrs):
            if tag == "section":
                self.counts[min(self.depth, 2)] += 1
                self.depth += 1

        def handle_endtag(self, tag):
            if tag == "section":
                self.depth -= 1

    parser = Sections()
    parser.feed(page)
    assert parser.depth == 0, "unbalanced <section> tags"
    return parser.counts[0], parser.counts[1]


def test_the_notebook_passes_are_nbconvert_preprocessors_that_run_before_the_templates(tmp_path):
    exporter = bs.slides_exporter(tmp_path)
    enabled = [type(p).__name__ for p in exporter._preprocessors if p.enabled]
    ours = ["EmbedLocalImages", "SplitAtHeadings", "MarkSlides"]
    assert [name for name in enabled if name in ours] == ours
    assert enabled.index("MarkSlides") < enabled.index("_RevealMetadataPreprocessor")
    # Run alone, the passes do what the functions do, and the input notebook is left as it was.
    nb = notebook(md("# T\n\n## Inner\n\n**1.** x"), code("print(1)"))
    before = copy.deepcopy(nb)
    out, _ = bs.MarkSlides().preprocess(*bs.SplitAtHeadings().preprocess(nb, {}))
    assert nb == before
    assert [c.metadata["slideshow"]["slide_type"] for c in out.cells] == ["slide", "slide", "-"]


def test_index_lists_every_deck(sample_decks):
    index = next(iter(sample_decks.values())).parent / "index.html"
    text = index.read_text(encoding="utf-8")
    assert len(sample_decks) == len(DECK_SAMPLE) and all(f'href="{name}"' in text for name in sample_decks)


# --- vendoring (with a stand-in for npm: no network here) --------------------------------------

FAKE_NPM = """#!{python}
import io, json, sys, tarfile
from pathlib import Path
spec, dest = sys.argv[2], Path(sys.argv[sys.argv.index("--pack-destination") + 1])
with open({log!r}, "a") as log:
    log.write(spec + "\\n")
name = spec.rsplit("@", 1)[0].replace("@", "").replace("/", "-") + ".tgz"
files = json.loads({files!r})
with tarfile.open(dest / name, "w:gz") as tar:
    for path in files:
        data = ("content of " + path).encode()
        info = tarfile.TarInfo("package/" + path)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
print(name)
"""


def fake_npm(tmp_path, files):
    log = tmp_path / "npm.log"
    npm = tmp_path / "npm"
    npm.write_text(FAKE_NPM.format(python=sys.executable, log=str(log), files=json.dumps(files)))
    npm.chmod(0o755)
    return npm, log


def test_vendor_keeps_only_the_listed_files_and_runs_npm_once(tmp_path, monkeypatch):
    files = ["dist/app.js", "dist/app.js.map", "dist/skip.js", "plugin/x.js", "src/app.ts", "LICENSE"]
    npm, log = fake_npm(tmp_path, files)
    monkeypatch.setattr(bs, "VENDOR", {"fake-pkg@1.2.3": ("fake", ("dist/", "LICENSE"), ("dist/skip.js",))})
    out = tmp_path / "slides"
    target = bs.vendor(out, npm=str(npm))
    kept = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert kept == [bs.VENDOR_STAMP, "fake/LICENSE", "fake/dist/app.js"]
    assert (target / "fake/dist/app.js").read_text() == "content of dist/app.js"
    bs.vendor(out, npm=str(npm))
    assert log.read_text().split() == ["fake-pkg@1.2.3"]  # the second build used what it had


def test_vendor_refuses_a_package_whose_files_leave_the_folder(tmp_path, monkeypatch):
    npm, _ = fake_npm(tmp_path, ["dist/app.js", "../../escape.js"])
    monkeypatch.setattr(bs, "VENDOR", {"evil-pkg@0.1.0": ("evil", ("dist/", "../"), ())})
    out = tmp_path / "slides"
    with pytest.raises(RuntimeError, match=r"evil-pkg@0\.1\.0: refusing to unpack '\.\./\.\./escape\.js'"):
        bs.vendor(out, npm=str(npm))
    written = [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()]
    assert sorted(written) == ["npm", "npm.log"]  # nothing unpacked, nothing outside the folder


def test_vendor_names_the_problem_when_npm_is_missing(tmp_path):
    with pytest.raises(RuntimeError, match="npm not found"):
        bs.vendor(tmp_path, npm="no-such-npm-binary-here")
    assert not (tmp_path / bs.VENDOR_DIR).exists()


def test_build_refuses_missing_notebooks(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.ipynb"):
        bs.build([tmp_path / "nope.ipynb"], tmp_path / "out", with_vendor=False)
    assert not (tmp_path / "out").exists()


def test_local_markdown_images_are_embedded_but_not_outside_files_or_urls(tmp_path):
    course, outside = tmp_path / "course", tmp_path / "secret.png"
    (course / "notebooks").mkdir(parents=True)
    (course / "figures").mkdir()
    (course / "figures" / "f.png").write_bytes(b"figure bytes")
    outside.write_bytes(b"not the course's")
    nb = notebook(md("![a figure](../figures/f.png) and <img src=\"../figures/f.png\" width=3>\n"
                     "![gone](../figures/missing.png) ![web](https://example.org/x.png) ![up](../../secret.png)"))
    before = copy.deepcopy(nb)
    embedded = bs.embed_local_images(nb, course / "notebooks", course)
    uri = "data:image/png;base64," + base64.b64encode(b"figure bytes").decode()
    assert embedded.cells[0].source == (
        f"![a figure]({uri}) and <img src=\"{uri}\" width=3>\n"
        "![gone](../figures/missing.png) ![web](https://example.org/x.png) ![up](../../secret.png)")
    assert nb == before
