"""A lecture deck, opened from disk in Chromium, works with no network at all.

Builds chapter 02's deck the way ``make slides`` does (reveal.js & co. fetched once with
``npm pack``; npm's cache serves later runs) and opens it from a file: URL. Every request the
page makes must stay on the machine, reveal.js must start, every figure must decode, the
stepper must render from the saved widget state, and the arrow keys must change slides.
"""
from __future__ import annotations

import shutil

import pytest

from tests.helpers import load_build_slides

from labdriver import NOTEBOOKS, REPO, wait_until

CHAPTER = NOTEBOOKS / "02_block_manager.ipynb"


@pytest.fixture(scope="module")
def deck(tmp_path_factory):
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: the deck's reveal.js/require.js/MathJax/widget manager "
                    "are fetched with `npm pack` (Debian: apt-get install npm)")
    bs = load_build_slides()
    return bs.build([CHAPTER], tmp_path_factory.mktemp("deck"))[0]


def test_deck_opens_offline_with_figures_widgets_and_navigation(browser, deck, shots):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    context.set_default_timeout(30_000)
    page = context.new_page()
    errors, remote = [], []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("request", lambda req: None if req.url.startswith(("file:", "data:", "blob:"))
            else remote.append(req.url))
    try:
        page.goto(deck.as_uri())
        page.locator(".reveal.ready").wait_for(state="attached")
        wait_until(lambda: page.evaluate("Array.from(document.images).every(i => i.complete)"), 20,
                   "every image of the deck to load")
        widths = page.evaluate("Array.from(document.images).map(i => i.naturalWidth)")
        assert widths and all(w > 0 for w in widths), f"images that did not decode: {widths}"

        label = page.locator(".course-stepper .stepper-label").first
        label.wait_for(state="attached")
        assert label.text_content().startswith("step 1 of ")

        start = page.evaluate("location.hash")
        page.keyboard.press("ArrowRight")
        wait_until(lambda: page.evaluate("location.hash") != start, 10, "the next slide")
        page.screenshot(path=shots / "slides-02-second-slide.png")
        # Jump to the stepper's slide by its address, as a lecturer's link would, and look at it.
        address = page.evaluate("""() => {
            const inner = document.querySelector('.course-stepper').closest('section');
            const outer = inner.parentElement.closest('section') || inner;
            const h = Array.from(document.querySelectorAll('.slides > section')).indexOf(outer);
            const v = outer === inner ? 0 : Array.from(outer.children).filter(e => e.tagName === 'SECTION').indexOf(inner);
            return '#/' + h + '/' + v;
        }""")
        page.evaluate("(address) => { location.hash = address; }", address)
        wait_until(lambda: page.locator("section.present .course-stepper").count() > 0, 10,
                   f"the stepper's slide {address} to be shown")
        stepper = page.locator("section.present .course-stepper").first
        stepper.scroll_into_view_if_needed()
        page.screenshot(path=shots / "slides-02-stepper-slide.png")
        assert errors == [], f"script errors in the deck: {errors}"
        assert remote == [], f"the deck asked the network for: {remote}"
    finally:
        context.close()
