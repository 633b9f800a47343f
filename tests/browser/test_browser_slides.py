"""A lecture deck, opened from disk in Chromium, works with no network at all.

Builds chapter 02's deck the way ``make slides`` does (reveal.js & co. fetched once with
``npm pack``; npm's cache serves later runs) and opens it from a file: URL. Every request the
page makes must stay on the machine, reveal.js must start, every figure must decode, the
stepper must render from the saved widget state, and the arrow keys must change slides.
"""
from __future__ import annotations

import re
import shutil

import pytest
from playwright.sync_api import expect

from tests.helpers import load_build_slides

from labdriver import NOTEBOOKS

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
    page = context.new_page()
    errors, remote = [], []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("request", lambda req: None if req.url.startswith(("file:", "data:", "blob:"))
            else remote.append(req.url))
    try:
        page.goto(deck.as_uri())
        expect(page.locator(".reveal.ready")).to_be_attached()
        page.wait_for_function("Array.from(document.images).every(i => i.complete)")
        widths = page.evaluate("Array.from(document.images).map(i => i.naturalWidth)")
        assert widths and all(w > 0 for w in widths), f"images that did not decode: {widths}"

        expect(page.locator(".course-stepper .stepper-label").first).to_contain_text(re.compile(r"^step 1 of "))

        start = page.url
        page.keyboard.press("ArrowRight")
        expect(page).not_to_have_url(start)
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
        stepper = page.locator("section.present .course-stepper").first
        expect(stepper).to_be_attached()
        stepper.scroll_into_view_if_needed()
        page.screenshot(path=shots / "slides-02-stepper-slide.png")
        assert errors == [], f"script errors in the deck: {errors}"
        assert remote == [], f"the deck asked the network for: {remote}"
    finally:
        context.close()
