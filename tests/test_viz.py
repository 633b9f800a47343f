"""The visualization toolkit: snapshots are values, text and figures reflect the state,
the recorder records exactly the calls that happened, the stepper shows the step chosen."""
from __future__ import annotations

import dataclasses
import html
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib.figure import Figure

from course_pkg import BlockManager, NoFreeBlocksError, Sequence
from course_pkg.viz import (Recorder, Snapshot, Stepper, draw_snapshot, draw_steps, figure_png,
                            render_text, short_hash, show, take_snapshot)
from course_pkg.viz.draw import STATE_COLORS
from tests.helpers import state

BS = 4


def seq(tokens, block_size=BS) -> Sequence:
    return Sequence(list(tokens), block_size=block_size)


def shared_prefix_run():
    """Two sequences that share two full blocks: A computes and registers them, B hits them."""
    rec = Recorder(BlockManager(8, BS))
    a = rec.name(seq(range(1, 11)), "A")
    b = rec.name(seq(list(range(1, 9)) + [50, 51, 52]), "B")
    bm = rec.watch()
    bm.allocate(a, bm.can_allocate(a))
    a.num_cached_tokens = len(a)
    bm.hash_blocks(a)
    bm.allocate(b, bm.can_allocate(b))
    return rec, bm, a, b


def text_rows(text: str) -> dict[int, tuple[int, str]]:
    """block id -> (ref count, state) from render_text's table."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\s*(\d+)\s+(\d+)\s+(free|cached|exclusive|shared)\s", line)
        if m:
            rows[int(m[1])] = (int(m[2]), m[3])
    return rows


def figure_texts(fig: Figure) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


# ------------------------------------------------------------------ snapshots and text

def test_snapshot_is_a_value_later_calls_do_not_change_it():
    bm = BlockManager(6, BS)
    a = seq(range(1, 10))
    bm.allocate(a, 0)
    snap = take_snapshot(bm, {"A": a}, "after allocate")
    before_text = render_text(snap)
    before = dataclasses.astuple(snap)

    a.num_cached_tokens = len(a)
    bm.hash_blocks(a)
    bm.deallocate(a)
    bm.allocate(seq([7] * 13), 0)

    assert dataclasses.astuple(snap) == before
    assert render_text(snap) == before_text
    assert snap.block_tables == (("A", (0, 1, 2)),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.label = "changed"  # type: ignore[misc]
    assert isinstance(snap.blocks[0].token_ids, tuple)


def test_text_is_deterministic_and_shows_shared_and_cached_blocks():
    rec1, bm, a, b = shared_prefix_run()
    rec2, *_ = shared_prefix_run()          # the same run again, other seq ids
    assert [render_text(s) for s in rec1.snapshots] == [render_text(s) for s in rec2.snapshots]

    text = render_text(rec1.snapshots[-1])
    rows = text_rows(text)
    assert rows[0] == (2, "shared") and rows[1] == (2, "shared")
    assert rows[a.block_table[2]] == (1, "exclusive")
    assert rows[b.block_table[2]] == (1, "exclusive")
    assert "block table A: [0, 1, 2]" in text and "block table B: [0, 1, 3]" in text

    bm.deallocate(b)
    bm.deallocate(a)
    after = rec1.snapshots[-1]
    text = render_text(after)
    # Reversed release: A's tail first, its prefix last; registered blocks stay cached.
    assert after.free_queue == tuple(bm.free_block_ids)
    assert list(after.free_queue[-3:]) == [2, 1, 0]
    assert text_rows(text)[0] == (0, "cached")
    queue_line = next(line for line in text.splitlines() if line.startswith("free queue"))
    assert queue_line.endswith("3 2 1* 0*")


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["admit", "append", "hash", "release"]),
                              st.integers(0, 3), st.integers(1, 9)), max_size=25),
       block_size=st.sampled_from([1, 2, 3, 4]))
def test_every_recorded_snapshot_equals_the_state_right_after_its_call(ops, block_size):
    bm = BlockManager(10, block_size)
    rec = Recorder(bm)
    proxy = rec.watch()
    live: dict[int, Sequence] = {}
    expected = []   # independent copy of the state after each recorded call
    for op, slot, n in ops:
        s = live.get(slot)
        if op == "admit" and s is None:
            s = rec.name(seq([1, 2, 3, 4, 5, 6, 7, 8][:n], block_size), f"S{len(rec.sequences)}")
            hits = proxy.can_allocate(s)
            expected.append(state(bm))
            if hits >= 0:
                proxy.allocate(s, hits)
                live[slot] = s
                expected.append(state(bm))
        elif op == "append" and s is not None:
            s.append_token(n)
            if proxy.can_append(s):
                expected.append(state(bm))
                proxy.may_append(s)
                expected.append(state(bm))
            else:
                expected.append(state(bm))
                s.token_ids.pop(); s.num_tokens -= 1
        elif op == "hash" and s is not None:
            s.num_cached_tokens = len(s) - 1
            proxy.hash_blocks(s)
            expected.append(state(bm))
        elif op == "release" and s is not None:
            proxy.deallocate(s)
            del live[slot]
            expected.append(state(bm))
    assert len(rec.snapshots) == len(expected)
    for snap, real in zip(rec.snapshots, expected):
        assert tuple(dataclasses.astuple(b)[:4] for b in snap.blocks) == real.blocks
        assert snap.free_queue == real.free_queue and set(snap.used) == real.used
        assert tuple(sorted(snap.hash_index)) == real.hash_index
        # The text's free queue is the real one, head first, starring exactly the blocks the
        # real index still points at.
        index = dict(real.hash_index)
        queue = " ".join(f"{b}*" if index.get(real.blocks[b][2]) == b else str(b) for b in real.free_queue)
        assert f"free queue (head -> tail, * = still cached): {queue or '(empty)'}" in render_text(snap).splitlines()
        rows = text_rows(render_text(snap))
        for b in snap.blocks:
            if b.ref_count or b.hash != -1:
                assert rows[b.block_id] == (b.ref_count, snap.state(b.block_id))
    # The last snapshot's held tokens: what each live sequence keeps in each block of its table.
    if rec.snapshots:
        last = rec.snapshots[-1]
        for s in live.values():
            for i, block_id in enumerate(s.block_table):
                assert last.blocks[block_id].held_tokens == tuple(s.token_ids[i * block_size:(i + 1) * block_size])
        held = {b for s in live.values() for b in s.block_table}
        assert all(b.held_tokens == () for b in last.blocks if b.block_id not in held)


def test_text_shows_the_tokens_of_unregistered_blocks_the_ones_copy_on_write_acts_on():
    bm = BlockManager(8, BS)
    a = seq([1, 2, 3, 4, 5, 6])
    bm.allocate(a, 0)
    # Nothing registered yet: both blocks show what A keeps in them, in parentheses.
    assert text_rows_tokens(render_text(take_snapshot(bm, {"A": a}))) == {0: "(1 2 3 4)", 1: "(5 6)"}
    a.num_cached_tokens = len(a)
    bm.hash_blocks(a)
    b = a.fork(1)
    bm.fork(a, b)
    text = render_text(take_snapshot(bm, {"A": a, "B": b}))
    assert text_rows_tokens(text) == {0: "[1 2 3 4]", 1: "(5 6)"}        # block 1: shared, partial
    assert "    1    2  shared        -  (5 6)" in text.splitlines()
    a.append_token(70)                      # written into the shared block, before may_append:
    assert text_rows_tokens(render_text(take_snapshot(bm)))[1] == "(5 6)"   # what both still hold
    assert bm.may_append(a) == [(1, 2)]
    # The copy holds A's three tokens, the original B's two; the holders are found unnamed too.
    assert text_rows_tokens(render_text(take_snapshot(bm))) == {0: "[1 2 3 4]", 1: "(5 6)", 2: "(5 6 70)"}
    bm.deallocate(a)
    bm.deallocate(b)
    assert text_rows_tokens(render_text(take_snapshot(bm))) == {0: "[1 2 3 4]"}   # free: nobody holds 1, 2


def text_rows_tokens(text: str) -> dict[int, str]:
    """block id -> the tokens column of render_text's table."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\s*(\d+)\s+\d+\s+(?:free|cached|exclusive|shared)\s+\S+\s+(.*)$", line)
        if m:
            rows[int(m[1])] = m[2]
    return rows


# ------------------------------------------------------------------ recorder

def test_recorder_labels_one_snapshot_per_call():
    rec, bm, a, b = shared_prefix_run()
    assert rec.labels == ["can_allocate(A) -> 0", "allocate(A, 0)", "hash_blocks(A)",
                          "can_allocate(B) -> 2", "allocate(B, 2)"]
    assert all(isinstance(s, Snapshot) for s in rec.snapshots)
    assert bm.can_append(a) is True          # the proxy returns the real answer
    a.append_token(99)
    bm.may_append(a)
    snap = rec.record("after a step")
    assert rec.labels[-3:] == ["can_append(A) -> True", "may_append(A)", "after a step"]
    assert rec.snapshots[-1] is snap and len(rec.snapshots) == 8
    # Reads go through to the real manager; unnamed sequences get a default name.
    assert bm.num_free_blocks == rec.block_manager.num_free_blocks
    c = seq([5, 5])
    bm.allocate(c, 0)
    assert rec.labels[-1] == f"allocate(seq {c.seq_id}, 0)"
    assert ("seq %d" % c.seq_id, tuple(c.block_table)) in rec.snapshots[-1].block_tables
    assert rec.sequences == {"A": a, "B": b, f"seq {c.seq_id}": c}


def test_recorder_keyword_arguments_and_names():
    rec = Recorder(BlockManager(4, 2), {"X": seq([1, 2, 3], 2)})
    x = rec.sequences["X"]
    rec.watch().allocate(x, num_cached_blocks=0)
    assert rec.labels == ["allocate(X, num_cached_blocks=0)"]
    with pytest.raises(ValueError, match="already used"):
        rec.name(seq([1], 2), "X")
    rec.name(x, "renamed")
    assert rec.record("r").block_tables == (("renamed", tuple(x.block_table)),)
    with pytest.raises(TypeError):
        Recorder("not a manager")  # type: ignore[arg-type]


@pytest.mark.parametrize("misuse, error", [
    ("allocate_twice", ValueError),
    ("deallocate_unallocated", ValueError),
    ("allocate_without_room", NoFreeBlocksError),
    ("append_unallocated", ValueError),
    ("wrong_block_size", ValueError),
])
def test_misuse_through_the_proxy_raises_and_records_nothing(misuse, error):
    rec, bm, a, b = shared_prefix_run()
    big = rec.name(seq(range(100, 140)), "BIG")
    idle = rec.name(seq([1, 2, 3]), "IDLE")
    n_before = len(rec.snapshots)
    real_before = state(rec.block_manager, [a, b, big, idle])
    call = {
        "allocate_twice": lambda: bm.allocate(a, 0),
        "deallocate_unallocated": lambda: bm.deallocate(idle),
        "allocate_without_room": lambda: bm.allocate(big, 0),
        "append_unallocated": lambda: bm.may_append(idle),
        "wrong_block_size": lambda: bm.can_allocate(seq([1, 2, 3], block_size=2)),
    }[misuse]
    with pytest.raises(error):
        call()
    assert len(rec.snapshots) == n_before
    assert state(rec.block_manager, [a, b, big, idle]) == real_before


def test_proxy_refuses_to_set_state():
    rec, bm, *_ = shared_prefix_run()
    with pytest.raises(AttributeError, match="through the recording proxy"):
        bm.free_block_ids = []
    assert len(rec.block_manager.free_block_ids) == 4


# ------------------------------------------------------------------ figures

def test_figure_reflects_the_state():
    rec, bm, a, b = shared_prefix_run()
    bm.deallocate(b)
    snap = rec.snapshots[-1]           # block 3 (B's own block) is free, 0 and 1 are held by A
    fig = draw_snapshot(snap)
    texts = figure_texts(fig)
    assert snap.label in texts
    assert texts.count("ref 1") == 3 and "ref 2" not in texts
    assert "A" in texts and "B" not in texts   # only live tables are drawn
    # A's prefix registered and A holds it: its hash tags show in the cells and the index.
    assert len(snap.hash_index) == 2
    for h, block_id in snap.hash_index:
        assert short_hash(h) in texts                                   # the cell's tag
        assert any(t.startswith(f"{short_hash(h)} -> {block_id} ") for t in texts)   # the index
    fig2 = draw_snapshot(rec.snapshots[-2])
    assert figure_texts(fig2).count("ref 2") == 2
    # Colours: a shared cell exists only in the state with a shared block.
    shared = STATE_COLORS["shared"]

    def n_fill(f, color):
        from matplotlib.colors import to_hex
        return sum(to_hex(p.get_facecolor()) == color for ax in f.axes for p in ax.patches)
    # 2 pool cells, and the first two entries of both A's and B's table (1 = the legend swatch).
    assert n_fill(fig, shared) == 1
    assert n_fill(fig2, shared) == 1 + 2 + 2 * 2


def test_cached_free_blocks_are_marked():
    rec, bm, a, b = shared_prefix_run()
    bm.deallocate(b)
    bm.deallocate(a)
    texts = figure_texts(draw_snapshot(rec.snapshots[-1]))
    assert texts.count("cached") == 2        # blocks 0 and 1: free, still in the index


def test_png_is_deterministic_and_differs_between_states():
    rec, *_ = shared_prefix_run()
    first = figure_png(draw_snapshot(rec.snapshots[-1]))
    assert first[:8] == b"\x89PNG\r\n\x1a\n"
    assert figure_png(draw_snapshot(rec.snapshots[-1])) == first
    assert figure_png(draw_snapshot(rec.snapshots[0])) != first


def test_draw_steps_one_panel_per_snapshot():
    rec, *_ = shared_prefix_run()
    fig = draw_steps(rec.snapshots, ncols=2, title="run")
    assert len(fig.axes) == len(rec.snapshots) + 1       # one panel per step, plus the shared legend
    for k, snap in enumerate(rec.snapshots):
        assert "ref 2" in [t.get_text() for t in fig.axes[k].texts] or not any(
            b.ref_count == 2 for b in snap.blocks)
    assert [t.get_text() for t in fig.axes[-1].texts] == ["free", "free, still cached",
                                                          "exclusive (ref 1)", "shared (ref > 1)"]
    assert "5. allocate(B, 2)" in figure_texts(fig)
    with pytest.raises(ValueError):
        draw_steps([])


def test_large_pool_is_drawn_with_elisions():
    bm = BlockManager(100, 2)
    for k in range(30):
        s = seq([k, k + 1, k + 2], 2)
        bm.allocate(s, 0)
        s.num_cached_tokens = 3
        bm.hash_blocks(s)
        bm.deallocate(s)
    texts = figure_texts(draw_snapshot(take_snapshot(bm, [], "big")))
    assert "..." in texts and any(t.startswith("... ") and t.endswith("more") for t in texts)


def test_many_and_long_block_tables_are_elided():
    bm = BlockManager(400, 2)
    seqs = {}
    for k in range(13):
        s = seq(list(range(40)) + [1000 + k] * (3 + k), 2)
        bm.allocate(s, bm.can_allocate(s))
        s.num_cached_tokens = len(s)
        bm.hash_blocks(s)
        seqs[f"request-{k}"] = s
    texts = figure_texts(draw_snapshot(take_snapshot(bm, seqs, "many")))
    assert "... 3 more sequences" in texts
    assert "request-9" in texts and "request-10" not in texts
    # A 22..28-entry table shows its first 12 and last 3 entries around "...".
    assert texts.count("...") >= 10
    assert texts.count("ref 13") == 20           # the shared 20-block prefix


def test_show_prints_text_and_displays_a_png(monkeypatch, capsys):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    rec, *_ = shared_prefix_run()
    show(rec.snapshots[-1])
    assert capsys.readouterr().out == render_text(rec.snapshots[-1]) + "\n"
    assert len(shown) == 1 and shown[0].data[:4] == b"\x89PNG"


# ------------------------------------------------------------------ stepper

def test_stepper_controls_change_what_is_shown():
    rec, *_ = shared_prefix_run()
    snaps = rec.snapshots
    stepper = Stepper(snaps)

    def shows(i):
        assert stepper.index == i
        assert html.escape(snaps[i].label) in stepper.label.value
        assert f"step {i + 1} of {len(snaps)}" in stepper.label.value
        assert stepper.text.value == f"<pre style='line-height:1.25'>{html.escape(render_text(snaps[i]))}</pre>"
        assert stepper.figure.value == stepper.png(i)

    shows(0)
    assert stepper.prev_button.disabled and not stepper.next_button.disabled
    first_png = stepper.figure.value
    stepper.next_button.click()
    shows(1)
    assert stepper.figure.value != first_png
    stepper.slider.value = 4
    shows(4)
    assert stepper.next_button.disabled
    stepper.next_button.click()      # clamped at the end
    shows(4)
    stepper.prev_button.click()
    shows(3)
    stepper.go(-5)
    shows(0)
    # Play moves the slider in the browser through a jslink.
    assert stepper.play_link.source == (stepper.play, "value")
    assert stepper.play_link.target == (stepper.slider, "value")
    assert stepper.play.max == stepper.slider.max == len(snaps) - 1


def test_stepper_css_hooks_and_bad_input():
    rec, *_ = shared_prefix_run()
    stepper = Stepper(rec.snapshots)
    assert "course-stepper" in stepper._dom_classes
    for widget, cls in ((stepper.label, "stepper-label"), (stepper.text, "stepper-text"),
                        (stepper.figure, "stepper-figure"), (stepper.prev_button, "stepper-prev"),
                        (stepper.next_button, "stepper-next"), (stepper.slider, "stepper-slider")):
        assert cls in widget._dom_classes
    with pytest.raises(ValueError):
        Stepper([])
    with pytest.raises(TypeError):
        Stepper(["not a snapshot"])  # type: ignore[list-item]


def test_make_figures_is_deterministic_and_makes_the_readme_picture():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "make_figures.py"
    spec = importlib.util.spec_from_file_location("make_figures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    first, second = module.figures(), module.figures()
    assert first == second
    assert {"block_manager_state.png", "block_manager_steps.png"} <= set(first)
    assert all(png[:8] == b"\x89PNG\r\n\x1a\n" for png in first.values())


# ------------------------------------------------------------------ exercise checks

from course_pkg.viz import check, check_function, predict, same_answer, show_lines  # noqa: E402


@pytest.mark.parametrize("answer, expected, tolerance", [
    (True, 1, None), (1, True, None), (1.0, 1, None), (1, 1.0, 0.1), ("1", 1, None),
    ([1, 2], (1, 2), None), ((1, True), (1, 1), None), ({"a": 1}, {"a": 1.0}, 0.1),
    ([0, 1], [0, 1, 2], None),
])
def test_check_is_type_strict(answer, expected, tolerance, capsys):
    assert not same_answer(answer, expected, tolerance)
    check(answer, expected, tolerance=tolerance)
    assert capsys.readouterr().out.startswith("Not quite")


def test_check_accepts_the_same_value_of_the_same_type(capsys):
    for value in (3, True, "B", (3, "shared"), [3, 4, 2, 1, 0], {"x": [1, 2]}):
        check(value, value)
        assert capsys.readouterr().out == "Correct.\n"


def test_floats_need_a_stated_tolerance(capsys):
    with pytest.raises(ValueError, match="tolerance"):
        check(0.1353, 0.1353)
    check(0.1353, 0.13533528, tolerance=1e-4)
    assert capsys.readouterr().out.startswith("Correct")
    check(0.14, 0.13533528, tolerance=1e-4)
    assert capsys.readouterr().out.startswith("Not quite")
    assert not same_answer(float("nan"), 0.5, tolerance=1.0)


def test_an_unanswered_exercise_says_so(capsys):
    check(..., 3)
    def todo(n):
        ...
    check_function(todo, lambda n: n, [1, 2])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Not answered yet") and out[1].startswith("Not answered yet")


def test_predict_runs_the_experiment_only_after_a_prediction_and_is_type_strict(capsys):
    runs = []

    def experiment():
        runs.append(1)
        return (3, [1, 1, 0])

    predict(..., experiment)
    assert capsys.readouterr().out.startswith("Not answered yet") and runs == []
    predict((3, [1, 1, 0]), experiment)
    assert capsys.readouterr().out == "Correct: you predicted (3, [1, 1, 0]), the package gives (3, [1, 1, 0]).\n"
    for wrong in ((3, [True, 1, 0]), [3, [1, 1, 0]], (3, [1, 1]), True):
        predict(wrong, experiment, hint="count the sharers")
        out = capsys.readouterr().out
        assert out.startswith(f"Not quite: you predicted {wrong!r}") and out.endswith("Why: count the sharers\n")
    predict(True, lambda: 1)
    assert "(a bool; the answer is an int)" in capsys.readouterr().out
    assert len(runs) == 5


def test_check_function_reports_the_first_failing_case(capsys):
    def blocks(n, bs):
        return n // bs            # wrong: should round up
    check_function(blocks, lambda n, bs: -(-n // bs), [(8, 4), (9, 4), (10, 4)])
    out = capsys.readouterr().out
    assert "blocks(9, 4) returned 2" in out and "expected 3" in out
    check_function(lambda n, bs: -(-n // bs), lambda n, bs: (n + bs - 1) // bs,
                   [(n, bs) for n in range(1, 30) for bs in (1, 3, 16)])
    assert capsys.readouterr().out == "Correct on all 87 cases.\n"


def test_show_lines_shows_an_excerpt_between_markers():
    def sample():
        a = 1
        b = 2
        c = 3
        return a + b + c
    text = show_lines(sample, "b = 2", "c = 3").data
    assert text == "b = 2\nc = 3"
    assert show_lines(sample, "return").data == "return a + b + c"
    with pytest.raises(ValueError, match="no line containing 'zzz'"):
        show_lines(sample, "zzz")
