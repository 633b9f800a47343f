"""What a lab is, and what grading one returns.

A ``Lab`` names the code a chapter teaches, the package's own implementation of it (the
``reference``), a ``stub`` for the student to fill in, and ``mutants``: known-wrong
implementations that the grader must reject. ``grade(impl)`` runs the lab's scenarios on
``impl`` and returns a ``LabReport``.

A lab's parts are named as ``"module:attribute"`` strings and imported on first use, so
``LABS`` is cheap to import (the kernel labs import Triton only when they are graded) and
adding a lab is one entry in ``course_pkg.labs.registry``.
"""
from __future__ import annotations

import importlib
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


def resolve(path: str):
    """The object ``"package.module:attr.sub"`` names."""
    module_name, _, attr = path.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class ScenarioFailed(Exception):
    """Raised by ``Grading.fail``: stops the current scenario (later steps would only repeat it)."""


#: Seconds of CPU time a scenario may use before it is stopped as a failure (a student's endless
#: loop). CPU time, not wall-clock time: a machine busy with other work (a classroom grading at
#: once, CI) slows a scenario down without using up its budget.
SCENARIO_TIME_LIMIT = 30
#: A scenario may also take this many times its limit in wall-clock time (code that waits, or
#: sleeps, uses no CPU time).
WALL_FACTOR = 4


class ScenarioTimeout(Exception):
    """A scenario ran past its time limit (raised by an alarm, Unix main thread only)."""


class Grading:
    """Collects a grader's failures, one scenario at a time.

    A grader runs each scenario inside ``with g.scenario("name"):``. The first failed check
    ends that scenario and is recorded as ``"name: what differed"``; an exception raised by the
    student's code is recorded the same way (``sys.exit`` included: graded code must not
    exit), and so is a scenario that uses more than ``time_limit`` seconds of CPU time, or
    ``WALL_FACTOR`` times that in wall-clock time (where timer signals can be used). The other scenarios still run, so the report lists everything that is
    wrong, not only the first thing.

    The alarm stops ordinary loops only: code that catches the timeout keeps running. The
    command line (``python -m course_pkg.labs``) grades in a child process that it kills.
    """

    #: What a scenario records as a failure of the code under test instead of letting it end
    #: the grading (the command line's child process adds ``KeyboardInterrupt``; in a notebook
    #: that is the reader's stop button).
    caught: tuple[type[BaseException], ...] = (Exception, SystemExit)

    def __init__(self, time_limit: float = SCENARIO_TIME_LIMIT):
        self.time_limit = time_limit
        self.failures: list[str] = []
        self.notes: list[str] = []
        self.scenarios: list[str] = []
        self._current: str | None = None

    def started(self, name: str) -> None:
        """Called as scenario ``name`` begins (a hook: the command line reports it)."""

    def ended(self, name: str, failure: str | None, seconds: float) -> None:
        """Called as scenario ``name`` ends, with its failure or None (a hook, as ``started``)."""

    @contextmanager
    def scenario(self, name: str) -> Iterator[None]:
        self.scenarios.append(name)
        self._current = name
        before = len(self.failures)
        self.started(name)
        start = time.perf_counter()
        limit = self.time_limit
        alarm = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
        if alarm:
            def on_cpu(signum, frame):
                raise ScenarioTimeout(f"still running after {limit:g} s of CPU time (an endless loop?)")

            def on_wall(signum, frame):
                raise ScenarioTimeout(f"still running after {WALL_FACTOR * limit:g} s (waiting for something?)")
            previous = signal.signal(signal.SIGPROF, on_cpu), signal.signal(signal.SIGALRM, on_wall)
            signal.setitimer(signal.ITIMER_PROF, limit)           # CPU time of the process
            signal.setitimer(signal.ITIMER_REAL, WALL_FACTOR * limit)
        try:
            yield
        except ScenarioFailed:
            if len(self.failures) == before:   # raised by the code under test, not by ``fail``
                self.failures.append(f"{name}: raised ScenarioFailed, the grader's own exception, "
                                     "from the code under test")
        except self.caught as e:  # the code under test crashed: that is a failure of this scenario
            self.failures.append(f"{name}: raised {type(e).__name__}{f': {e}' if str(e) else ''}{_hint(e)}")
        finally:
            if alarm:
                signal.setitimer(signal.ITIMER_PROF, 0)
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGPROF, previous[0])
                signal.signal(signal.SIGALRM, previous[1])
            self._current = None
        self.ended(name, self.failures[before] if len(self.failures) > before else None,
                   time.perf_counter() - start)

    def fail(self, what: str):
        if self._current is None:
            raise RuntimeError("Grading.fail outside a scenario")
        self.failures.append(f"{self._current}: {what}")
        raise ScenarioFailed

    def check(self, condition: bool, what: str) -> None:
        if not condition:
            self.fail(what)

    def equal(self, got, expected, what: str) -> None:
        """Fail unless ``got == expected``; the message shows both."""
        if got != expected:
            self.fail(f"{what}: expected {expected!r}, got {got!r}")

    def note(self, text: str) -> None:
        """A measured figure for the report (the prefix cache's saving, a timing ratio)."""
        self.notes.append(text)

    @property
    def passed_so_far(self) -> bool:
        return not self.failures


def _hint(e: BaseException) -> str:
    if isinstance(e, SystemExit):
        return " (graded code must return, not exit)"
    if isinstance(e, KeyboardInterrupt):
        return " (raised by the code under test)"
    return ""


@dataclass
class LabReport:
    """The result of grading: ``passed`` and the ``failures`` (each "scenario: what differed")."""

    lab: str
    passed: bool
    failures: list[str]
    scenarios: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def __str__(self) -> str:
        verdict = "PASSED" if self.passed else f"FAILED ({len(self.failures)} of {len(self.scenarios)} scenarios)"
        lines = [f"lab {self.lab}: {verdict}"]
        lines += [f"  - {f}" for f in self.failures]
        lines += [f"  * {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle) -> None:  # IPython shows the report as text
        p.text(str(self))


@dataclass(frozen=True)
class Lab:
    """One graded exercise. Parts are ``"module:attr"`` paths, imported on first use."""

    name: str
    title: str
    chapter: int
    checks: str                              # one line: what the grader checks
    reference_path: str                      # the package's own implementation
    stub_path: str                           # what the student starts from
    grader_path: str                         # function(impl, Grading) -> None
    mutant_paths: dict[str, str] = field(default_factory=dict)
    solution_paths: tuple[str, ...] = ()     # the package code shown as the solution
    task: str = ""                           # what the student writes (markdown)

    @property
    def reference(self):
        return resolve(self.reference_path)

    @property
    def stub(self):
        return resolve(self.stub_path)

    @property
    def mutants(self) -> dict[str, object]:
        return {name: resolve(path) for name, path in self.mutant_paths.items()}

    @property
    def solution(self) -> list:
        return [resolve(p) for p in (self.solution_paths or (self.reference_path,))]

    def grade(self, impl) -> LabReport:
        """Run every scenario of this lab on ``impl``; return the report."""
        grader = resolve(self.grader_path)
        g = Grading()
        start = time.perf_counter()
        grader(impl, g)
        return LabReport(self.name, passed=not g.failures, failures=g.failures, scenarios=g.scenarios,
                         notes=g.notes, seconds=time.perf_counter() - start)
