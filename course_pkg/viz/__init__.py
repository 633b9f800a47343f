"""See the KV-cache bookkeeping: snapshots, text, figures, a recorder and a stepper."""
from course_pkg.viz.notebook import check, show_source
from course_pkg.viz.snapshot import BlockState, Snapshot, render_text, short_hash, take_snapshot

__all__ = ["check", "show_source", "BlockState", "Snapshot", "render_text", "short_hash", "take_snapshot"]
