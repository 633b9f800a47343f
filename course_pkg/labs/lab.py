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


#: Seconds a scenario may run before it is stopped as a failure (a student's endless loop).
SCENARIO_TIME_LIMIT = 30


class ScenarioTimeout(Exception):
    """A scenario ran past ``SCENARIO_TIME_LIMIT`` (raised by an alarm, Unix main thread only)."""


def _on_alarm(signum, frame):
    raise ScenarioTimeout(f"still running after {SCENARIO_TIME_LIMIT} s (an endless loop?)")


class Grading:
    """Collects a grader's failures, one scenario at a time.

    A grader runs each scenario inside ``with g.scenario("name"):``. The first failed check
    ends that scenario and is recorded as ``"name: what differed"``; an exception raised by the
    student's code is recorded the same way, and so is a scenario that runs past
    ``SCENARIO_TIME_LIMIT`` seconds (where an alarm signal can be used). The other scenarios
    still run, so the report lists everything that is wrong, not only the first thing.
    """

    def __init__(self):
        self.failures: list[str] = []
        self.notes: list[str] = []
        self.scenarios: list[str] = []
        self._current: str | None = None

    @contextmanager
    def scenario(self, name: str) -> Iterator[None]:
        self.scenarios.append(name)
        self._current = name
        alarm = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
        if alarm:
            previous = signal.signal(signal.SIGALRM, _on_alarm)
            signal.setitimer(signal.ITIMER_REAL, SCENARIO_TIME_LIMIT)
        try:
            yield
        except ScenarioFailed:
            pass
        except Exception as e:  # the code under test crashed: that is a failure of this scenario
            self.failures.append(f"{name}: raised {type(e).__name__}: {e}")
        finally:
            if alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            self._current = None

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
