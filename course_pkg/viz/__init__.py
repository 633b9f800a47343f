"""See the KV-cache bookkeeping: snapshots, text, figures, a recorder and a stepper."""
from course_pkg.viz.notebook import check, check_function, predict, same_answer, show_lines, show_source
from course_pkg.viz.snapshot import BlockState, Snapshot, render_text, short_hash, take_snapshot
from course_pkg.viz.draw import draw_snapshot, draw_steps, figure_png, show
from course_pkg.viz.recorder import Recorder, WatchedBlockManager
from course_pkg.viz.stepper import Stepper

__all__ = ["check", "check_function", "predict", "same_answer", "show_lines", "show_source", "BlockState", "Snapshot", "render_text", "short_hash", "take_snapshot",
           "draw_snapshot", "draw_steps", "figure_png", "show", "Recorder", "WatchedBlockManager",
           "Stepper"]
