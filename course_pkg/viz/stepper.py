"""Replay recorded snapshots in Jupyter: Play, a slider, previous/next buttons.

Each step shows the snapshot's label, its text (``render_text``, in a <pre>) and its figure
(PNG). Figures are rendered on first view and cached, so opening a long recording is quick.

CSS classes on the widgets give browser tests stable hooks: ``course-stepper`` (the box),
``stepper-label``, ``stepper-text``, ``stepper-figure``, ``stepper-prev``, ``stepper-next``,
``stepper-slider``, ``stepper-play``.
"""
from __future__ import annotations

import html
from collections.abc import Sequence as SequenceABC

import ipywidgets as widgets

from course_pkg.viz.draw import draw_snapshot, figure_png
from course_pkg.viz.snapshot import Snapshot, render_text


class Stepper(widgets.VBox):
    """A widget that shows one snapshot of a recording at a time.

    ``slider.value`` is the index of the step shown; Play, the buttons and the slider all
    move it, and every change redraws the label, the text and the figure.
    """

    def __init__(self, snapshots: SequenceABC[Snapshot], interval_ms: int = 1200, dpi: int = 80):
        snaps = list(snapshots)
        if not snaps:
            raise ValueError("Stepper needs at least one snapshot")
        for s in snaps:
            if not isinstance(s, Snapshot):
                raise TypeError(f"Stepper replays Snapshot values, got {type(s).__name__}")
        self.snapshots = snaps
        self._dpi = dpi
        self._png_cache: dict[int, bytes] = {}
        last = len(snaps) - 1

        self.play = widgets.Play(value=0, min=0, max=last, step=1, interval=interval_ms,
                                 description="Play", show_repeat=False)
        self.slider = widgets.IntSlider(value=0, min=0, max=last, step=1, description="step",
                                        continuous_update=True, readout=True)
        self.prev_button = widgets.Button(description="previous", icon="step-backward",
                                          layout=widgets.Layout(width="110px"))
        self.next_button = widgets.Button(description="next", icon="step-forward",
                                          layout=widgets.Layout(width="110px"))
        self.label = widgets.HTML()
        self.text = widgets.HTML()
        self.figure = widgets.Image(format="png", layout=widgets.Layout(max_width="100%"))

        # Play drives the slider in the browser itself, so it runs even while the kernel is busy.
        self.play_link = widgets.jslink((self.play, "value"), (self.slider, "value"))
        self.prev_button.on_click(lambda _: self.go(self.slider.value - 1))
        self.next_button.on_click(lambda _: self.go(self.slider.value + 1))
        self.slider.observe(self._on_index, names="value")

        for w, cls in ((self.label, "stepper-label"), (self.text, "stepper-text"),
                       (self.figure, "stepper-figure"), (self.prev_button, "stepper-prev"),
                       (self.next_button, "stepper-next"), (self.slider, "stepper-slider"),
                       (self.play, "stepper-play")):
            w.add_class(cls)
        controls = widgets.HBox([self.play, self.prev_button, self.slider, self.next_button])
        super().__init__([controls, self.label, self.text, self.figure])
        self.add_class("course-stepper")
        self._render(0)

    @property
    def index(self) -> int:
        """The step shown now (0-based)."""
        return self.slider.value

    def go(self, index: int) -> None:
        """Show step ``index``, clamped to the recording."""
        self.slider.value = max(0, min(len(self.snapshots) - 1, int(index)))

    def png(self, index: int) -> bytes:
        """The figure of step ``index`` as PNG bytes (rendered once, then cached)."""
        if index not in self._png_cache:
            self._png_cache[index] = figure_png(draw_snapshot(self.snapshots[index]), dpi=self._dpi)
        return self._png_cache[index]

    def _on_index(self, change) -> None:
        self._render(change["new"])

    def _render(self, index: int) -> None:
        snap = self.snapshots[index]
        n = len(self.snapshots)
        self.label.value = (f"<b>step {index + 1} of {n}:</b> "
                            f"<code>{html.escape(snap.label or '(no label)')}</code>")
        self.text.value = f"<pre style='line-height:1.25'>{html.escape(render_text(snap))}</pre>"
        self.figure.value = self.png(index)
        self.prev_button.disabled = index == 0
        self.next_button.disabled = index == n - 1
