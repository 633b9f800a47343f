"""Grading a student's file in a child process, for a classroom (``python -m course_pkg.labs``).

The student's code runs in a child process; the verdict is decided here, in the parent, from
what the child reports, one message per event: the file was imported, a scenario started, a
scenario ended (with its failure or none), the grader finished. The parent holds the clock:
the import and each scenario get a wall-clock limit, and a child that overruns one is killed,
whatever the code inside catches. So a file cannot pass by exiting early (``sys.exit(0)``,
``os._exit(0)``, at import or in a graded method), by crashing, by looping, or by swallowing
the timeout: each ends the child before it reports the grader finished, and that is a failure
with a message saying where it happened.

Patching the grader (``Grading``, ``Lab.grade``, ``Lockstep``) or the package it compares
against is caught in the child: before the student's file is imported, it loads every module
of the package the lab can use and records every attribute of those modules and of their
classes (and of a few standard modules the graders rely on, ``time`` and ``random`` among
them); after the import and after each scenario it checks that nothing was replaced. The
child's messages carry a token the parent hands it on its standard input before the student's
file runs, so a file that writes to the channel does not forge a report by accident.

The child grades only the file's own code (``course_pkg.labs.authorship``: the package's version
of what the lab asks for is guarded and its source unreadable from the file; the child runs in
a fresh temporary directory, the file's only place to write). And a pass is confirmed here:
every scenario's report carries the number and kinds of checks it made, which must equal those
of the package's own implementation graded the same way (``reference_checks``, run once per
version of the package and cached). Graded code that silences a failed check (through ``gc``)
or forges the channel's messages (its token is in the child's memory) gives other checks.
(Code run in the same process can always dig deeper; this is a classroom's guard against the
known tricks and honest mistakes, not a security boundary.)
"""
from __future__ import annotations

import ast
import builtins
import hashlib
import importlib
import importlib.util
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from course_pkg.labs import authorship
from course_pkg.labs.lab import WALL_FACTOR, Grading, Lab, resolve

#: Given as the file to grade, the child grades the package's own implementation.
REFERENCE = ":reference:"

#: Seconds the child may take to start and load the grader (before the student's file runs).
SETUP_LIMIT = 120.0
#: Seconds a graded file may take to import (wall-clock), and a scenario to run (CPU time; see
#: ``lab.WALL_FACTOR``), unless told otherwise.
IMPORT_LIMIT = 20.0
SCENARIO_LIMIT = 30.0
#: After this many scenarios ran past their limit, the rest are not run (an endless loop in a
#: method every scenario calls would otherwise cost the limit once per scenario).
MAX_TIMEOUTS = 2
#: Standard modules whose attributes the graders rely on, watched like the package's.
WATCHED_STDLIB = ("builtins", "time", "random", "collections", "itertools", "functools", "math",
                  "signal", "os", "json", "contextlib", "copy", "operator", "types")


def grace(limit: float) -> float:
    """How long past a scenario's wall-clock bound the parent waits before it kills: the child's
    own alarms fire first and stop an ordinary loop, which then counts as that scenario's failure
    only."""
    return 1.0 + 0.1 * limit


# ---------------------------------------------------------------- the report the parent builds

@dataclass
class ScenarioRecord:
    name: str
    passed: bool
    message: str | None
    seconds: float


@dataclass
class FileReport:
    """What grading a file found: one record per scenario that ran, and the problems that are
    no scenario's (the file did not import, the child was stopped, the grader was patched)."""

    lab: str
    file: str
    records: list[ScenarioRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    output: list[str] = field(default_factory=list)      # the last lines the child printed
    checks: dict[str, tuple[int, str]] = field(default_factory=dict)   # scenario -> (checks made, digest)
    finished: bool = False                              # the grader ran to its end

    @property
    def passed(self) -> bool:
        return self.finished and not self.problems and bool(self.records) and all(r.passed for r in self.records)

    def __str__(self) -> str:
        failed = [r for r in self.records if not r.passed]
        if self.passed:
            verdict = "PASSED"
        elif self.problems:
            verdict = "FAILED"
        else:
            verdict = f"FAILED ({len(failed)} of {len(self.records)} scenarios)"
        lines = [f"lab {self.lab}: {verdict}"]
        lines += [f"  - {r.name}: {r.message}" for r in failed]
        lines += [f"  - {p}" for p in self.problems]
        lines += [f"  * {n}" for n in self.notes]
        if self.output and not self.passed:
            lines.append(f"  what the graded file printed (last {len(self.output)} lines):")
            lines += [f"    | {line}" for line in self.output]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"lab": self.lab, "file": self.file, "passed": self.passed,
                "verdict": "PASSED" if self.passed else "FAILED", "problems": self.problems,
                "scenarios": [vars(r) for r in self.records], "notes": self.notes, "output": self.output}


# ---------------------------------------------------------------- the parent

def _signal_name(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


class _OutputTail(threading.Thread):
    """Reads the child's stdout and stderr, keeping the last lines (the student's prints)."""

    def __init__(self, stream, max_lines: int = 40):
        super().__init__(daemon=True)
        self.stream = stream
        self.lines: deque[str] = deque(maxlen=max_lines)
        self.start()

    def run(self) -> None:
        for raw in iter(self.stream.readline, b""):
            self.lines.append(raw.decode("utf-8", "replace").rstrip("\n")[:300])


def grade_file(lab: Lab, path: Path, attribute: str, *, import_limit: float = IMPORT_LIMIT,
               scenario_limit: float = SCENARIO_LIMIT) -> FileReport:
    """Grade ``attribute`` of the Python file ``path`` on ``lab`` in a child process, in a fresh
    temporary directory; then confirm each passed scenario against the package's own run."""
    with tempfile.TemporaryDirectory(prefix="course-lab-") as work:
        report = _run_child(lab, str(Path(path).resolve()), attribute, Path(work), import_limit, scenario_limit)
    report.file = str(path)
    if any(r.passed for r in report.records):
        _confirm(report, reference_checks(lab))
    return report


def _run_child(lab: Lab, path: str, attribute: str, work: Path, import_limit: float,
               scenario_limit: float) -> FileReport:
    report = FileReport(lab.name, path)
    token = secrets.token_hex(16)
    read_fd, write_fd = os.pipe()
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONHASHSEED="0",
               PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-c", "import sys; from course_pkg.labs.isolation import child_main; "
               "child_main(sys.argv[1:])", lab.name, path, attribute, str(write_fd), repr(scenario_limit)]
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             pass_fds=(write_fd,), start_new_session=True, env=env, cwd=work)
    os.close(write_fd)
    output = _OutputTail(child.stdout)
    try:
        child.stdin.write((token + "\n").encode())
        child.stdin.close()
    except BrokenPipeError:
        pass
    try:
        _follow(child, read_fd, token, report, Path(path).name, import_limit, scenario_limit)
    except KeyboardInterrupt:
        report.problems.append("interrupted from the keyboard; the grading process was stopped")
        raise
    finally:
        _kill(child)
        os.close(read_fd)
        output.join(timeout=2)
        report.output = list(output.lines)
    return report


# ---------------------------------------------------------------- the package's own run, to confirm with

def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "course_pkg" / "lab-references"


def _package_digest() -> str:
    """A digest of every source file of the package (and of the Python running it)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(sys.version.encode())
    for file in sorted(root.rglob("*.py")):
        h.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes())
    return h.hexdigest()[:20]


def reference_checks(lab: Lab) -> list[tuple[str, int, str]] | str:
    """(scenario, checks made, digest of their kinds) for the package's own implementation of
    ``lab``, graded by the same child: computed once per version of the package and cached. A
    string if that run did not pass (then nothing can be confirmed)."""
    cache = _cache_dir() / f"{lab.name}-{_package_digest()}.json"
    try:
        return [tuple(entry) for entry in json.loads(cache.read_text())]
    except (OSError, ValueError):
        pass
    with tempfile.TemporaryDirectory(prefix="course-lab-") as work:
        report = _run_child(lab, REFERENCE, "", Path(work), IMPORT_LIMIT, 4 * SCENARIO_LIMIT)
    if not report.passed:
        return f"the package's own run of lab {lab.name} did not pass ({report}); nothing could be confirmed"
    entries = [(r.name, *report.checks[r.name]) for r in report.records]
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(entries))
        os.replace(partial, cache)
    except OSError:
        pass                                   # no cache: the next grading runs it again
    return entries


def _confirm(report: FileReport, reference: list[tuple[str, int, str]] | str) -> None:
    """A scenario passes only if it made the checks the package's own run of it made.

    The child reports each scenario's checks (how many, and a digest of their kinds in order);
    graded code that silences a failed check, or reports a scenario the grader never ran,
    gives other checks than the reference's run, which the graded code cannot see."""
    if isinstance(reference, str):
        report.problems.append(reference)
        return
    expected = {name: (checks, digest) for name, checks, digest in reference}
    for record in report.records:
        if not record.passed:
            continue
        if record.name not in expected:
            record.passed, record.message = False, ("the package's own run of this lab has no scenario of this name: "
                                                    "the graded code reported it")
        elif report.checks.get(record.name) != expected[record.name]:
            record.passed, record.message = False, ("reported as passed, but the checks it made are not those "
                                                    "the package's own run of it makes: the graded code changed "
                                                    "the grading")
    names = [r.name for r in report.records]
    if report.finished and names != [name for name, _, _ in reference]:
        report.problems.append(f"the grader ran {len(names)} scenarios, the package's own run "
                               f"{len(reference)}: the graded code changed the grading")


def _kill(child: subprocess.Popen) -> None:
    """Stop the child and anything it started (its own session)."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()


def _follow(child, fd: int, token: str, report: FileReport, file_name: str,
            import_limit: float, scenario_limit: float) -> None:
    """Read the child's messages until it finishes, dies, or overruns a limit."""
    _Follower(child, token, report, file_name, import_limit, scenario_limit).run(fd)


class _Follower:
    """The parent's side of the channel: a small state machine over the child's messages.

    Phases: ``setup`` (the child loads the grader) -> ``import`` (the student's file runs) ->
    ``between`` <-> ``scenario``. Each phase has a deadline; the report gets one record per
    scenario that ended, and a problem for whatever ended the grading early.
    """

    def __init__(self, child, token: str, report: FileReport, file_name: str,
                 import_limit: float, scenario_limit: float):
        self.child, self.token, self.report, self.file_name = child, token, report, file_name
        self.import_limit = import_limit
        self.scenario_limit = scenario_limit
        self.step_limit = WALL_FACTOR * scenario_limit + grace(scenario_limit)
        self.phase, self.current = "setup", None
        self.started_at = time.monotonic()
        self.deadline = self.started_at + SETUP_LIMIT

    def run(self, fd: int) -> None:
        buffer = b""
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                _kill(self.child)
                return self._timed_out()
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:                      # the child closed the channel: it ended
                return self._ended()
            buffer += chunk
            if len(buffer) > 1 << 20:
                return self._stop("the grading channel received more than 1 MiB without a line end")
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if self._handle(line):
                    return

    def _stop(self, what: str) -> bool:
        self.report.problems.append(what)
        return True

    def _add_record(self, passed: bool, message: str | None, seconds: float | None = None) -> None:
        seconds = time.monotonic() - self.started_at if seconds is None else seconds
        self.report.records.append(ScenarioRecord(self.current, passed, message, round(seconds, 3)))

    def _timed_out(self) -> None:
        if self.phase == "setup":
            self._stop(f"the grader did not start within {SETUP_LIMIT:g} s; the grading process was stopped")
        elif self.phase == "import":
            self._stop(f"importing {self.file_name} did not finish within {self.import_limit:g} s (an endless "
                       "loop or a long computation at import time?); the grading process was stopped")
        elif self.phase == "scenario":
            self._add_record(False, f"still running after {self.step_limit:g} s: the code under test did not stop "
                                f"when its {self.scenario_limit:g} s of CPU time (or {WALL_FACTOR * self.scenario_limit:g} "
                                "s) were up (it catches the timeout, or never returns to Python); the grading "
                                "process was killed, so the scenarios after this one did not run")
            self._stop(f"grading stopped in scenario {self.current!r}: it ran past its time limit")
        else:
            self._stop(f"the grader made no progress for {self.step_limit:g} s after scenario {self.current!r}; "
                       "the grading process was stopped")

    def _ended(self) -> None:
        try:
            how = _signal_name(self.child.wait(timeout=5))
        except subprocess.TimeoutExpired:
            how = _signal_name(None)
        if self.phase == "setup":
            self._stop(f"the grader failed to start ({how}) before {self.file_name} was imported: see its output")
        elif self.phase == "import":
            self._stop(f"the grading process ended while importing {self.file_name} ({how}): a file to grade "
                       "must not exit (sys.exit, os._exit) or crash when it is imported")
        elif self.phase == "scenario":
            self._add_record(False, f"the grading process ended during this scenario ({how}): graded code must "
                                "return, not exit (os._exit) or crash")
            self._stop(f"grading stopped in scenario {self.current!r}: the scenarios after it did not run")
        else:
            self._stop(f"the grading process ended before the grader finished ({how}, after scenario "
                       f"{self.current!r}): graded code must not exit or crash")

    def _handle(self, line: bytes) -> bool:
        """Act on one message; True when the grading is over."""
        try:
            message = json.loads(line)
            genuine = isinstance(message, dict) and message.pop("token", None) == self.token
        except ValueError:
            genuine = False
        if not genuine:
            return self._stop("the grading channel received a message the grader did not send (does the "
                              "graded code write to file descriptors it did not open?); the grading process "
                              "was stopped")
        event, now, phase = message.get("event"), time.monotonic(), self.phase
        if event == "ready" and phase == "setup":
            self.phase, self.deadline = "import", now + self.import_limit
        elif event == "imported" and phase == "import":
            self.phase, self.deadline = "between", now + self.step_limit
        elif event == "start" and phase == "between":
            self.phase, self.current, self.started_at = "scenario", message["scenario"], now
            self.deadline = now + self.step_limit
        elif event == "end" and phase == "scenario" and message["scenario"] == self.current:
            self._add_record(message["failure"] is None, message["failure"], message["seconds"])
            self.report.checks[self.current] = (message["checks"], message["digest"])
            self.phase, self.deadline = "between", now + self.step_limit
        elif event == "done" and phase == "between":
            self.report.notes = list(message["notes"])
            if message["scenarios"] != len(self.report.records):
                return self._stop(f"the grader reported {message['scenarios']} scenarios, the channel "
                                  f"{len(self.report.records)}")
            self.report.finished = True
            return True
        elif event == "tampered" and phase == "scenario":
            self._add_record(False, message["message"])
            return self._stop(f"grading stopped in scenario {self.current!r}: the graded code changed the grader")
        elif event == "borrowed" and phase == "import":
            self.report.problems += [str(p) for p in message["problems"]]
            return True
        elif event in ("import_failed", "missing", "tampered", "grader_error", "stopped"):
            return self._stop(message["message"])
        else:
            return self._stop(f"the grading channel received {event!r} out of order (while {phase}); the "
                              "grading process was stopped")
        return False


# ---------------------------------------------------------------- the child

class _Channel:
    """Writes the child's messages to the parent. Everything it needs is bound here, before the
    student's file runs, so replacing ``os.write`` or ``json.dumps`` afterwards changes nothing."""

    def __init__(self, fd: int, token: str):
        self._fd, self._token = fd, token
        self._write, self._dumps = os.write, json.dumps

    def send(self, event: str, **fields) -> None:
        data = (self._dumps({"event": event, "token": self._token, **fields}) + "\n").encode()
        while data:
            data = data[self._write(self._fd, data):]


class _Stop(BaseException):
    """Stop grading (the graded code replaced part of the grader, or it keeps running past its
    limits); a BaseException, so a grader's own ``except Exception`` lets it through."""


class ChildGrading(Grading):
    """``Grading`` that reports each scenario to the parent and checks, after each, that the
    graded code left the grader alone. ``KeyboardInterrupt`` raised by the code under test is
    a failure of its scenario here (no reader presses a stop button in a child process)."""

    caught = (Exception, SystemExit, KeyboardInterrupt)

    def __init__(self, channel: _Channel, changes, time_limit: float):
        super().__init__(time_limit)
        self._channel, self._changes = channel, changes
        self._timeouts = 0
        self._checks: list[str] = []         # this scenario's checks, in order: "e" equal, "c" check, "f" fail
        self._digest = hashlib.sha256

    def equal(self, got, expected, what: str) -> None:
        self._checks.append("e")
        super().equal(got, expected, what)

    def check(self, condition: bool, what: str) -> None:
        self._checks.append("c")
        super().check(condition, what)

    def fail(self, what: str):
        self._checks.append("f")
        return super().fail(what)

    def started(self, name: str) -> None:
        self._checks = []
        self._channel.send("start", scenario=name)

    def ended(self, name: str, failure: str | None, seconds: float) -> None:
        changed = self._changes()
        if changed:
            self._channel.send("tampered", message=_tamper_message(changed))
            raise _Stop
        checks = "".join(self._checks)
        self._channel.send("end", scenario=name, failure=None if failure is None else failure[len(name) + 2:],
                           seconds=seconds, checks=len(checks), digest=self._digest(checks.encode()).hexdigest())
        if failure is not None and failure.startswith(f"{name}: raised ScenarioTimeout"):
            self._timeouts += 1
            if self._timeouts == MAX_TIMEOUTS:
                self._channel.send("stopped", message=(
                    f"{MAX_TIMEOUTS} scenarios ran past their {self.time_limit:g} s of CPU time: the scenarios after "
                    f"{name!r} were not run (find the endless loop first)"))
                raise _Stop


def _tamper_message(changed: list[str]) -> str:
    shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
    return (f"the graded code changed the grader or the package it is compared with ({shown}); grading "
            "needs the course's own code: write your solution in your own class or function, and leave "
            "the package's alone")


def _modules_of_lab(lab: Lab) -> list[str]:
    """Every module of the package the lab's grader, reference and stub can import, lazily too.

    Found by reading their source (``import`` statements anywhere, and the package's lazy
    top-level names), without running anything."""
    import course_pkg

    lazy = getattr(course_pkg, "_LAZY", {})
    todo = [p.partition(":")[0] for p in (lab.grader_path, lab.reference_path, lab.stub_path)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or not (name == "course_pkg" or name.startswith("course_pkg.")):
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, AttributeError, ValueError):   # ``from module import function``
            continue
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        seen.add(name)
        tree = ast.parse(Path(spec.origin).read_text(), spec.origin)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                todo += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                todo.append(node.module)
                for alias in node.names:
                    todo.append(f"{node.module}.{alias.name}")
                    if node.module == "course_pkg" and alias.name in lazy:
                        todo.append(lazy[alias.name])
        parent = name.rpartition(".")[0]
        if parent:
            todo.append(parent)
    return sorted(seen)


def _code_of(value):
    for get in (lambda v: v.__code__, lambda v: v.__func__.__code__, lambda v: v.fget.__code__):
        try:
            return get(value)
        except AttributeError:
            continue
    return None


def _watch():
    """Record the watched modules and their classes now; return a function that lists what
    was replaced, deleted or added in them since."""
    def entries(namespace) -> dict:
        return {k: (v, _code_of(v)) for k, v in list(namespace.items())}

    # New names in a module change nothing that ran before unless they shadow a builtin (Triton's
    # interpreter adds dozens to the module of a kernel it runs; a submodule import adds one).
    builtin_names = set(vars(builtins))
    watched = []          # (dotted name, module or class, its entries then, is a module, is ours)
    for name, module in list(sys.modules.items()):
        ours = name == "course_pkg" or name.startswith("course_pkg.")
        if module is None or not (ours or name in WATCHED_STDLIB):
            continue
        watched.append((name, module, entries(vars(module)), True, ours))
        if ours:
            for value in list(vars(module).values()):
                if isinstance(value, type) and value.__module__ == name:
                    watched.append((f"{name}.{value.__qualname__}", value, entries(vars(value)), False, True))

    def changes() -> list[str]:
        found = []
        for where, owner, before, is_module, ours in watched:
            if is_module and sys.modules.get(where) is not owner:
                found.append(f"module {where} was replaced in sys.modules")
            now = vars(owner)
            for attr, (value, code) in before.items():
                if attr not in now:
                    found.append(f"{where}.{attr} was deleted")
                elif now[attr] is not value or _code_of(now[attr]) is not code:
                    found.append(f"{where}.{attr} was replaced")
            if ours:     # a new name in a class shadows an inherited one; in a module, a builtin
                found += [f"{where}.{attr} was added" for attr in now.keys() - before.keys()
                          if not is_module or attr in builtin_names]
        return found

    return changes


def _load_module(path: Path, set_globals=None):
    spec = importlib.util.spec_from_file_location(f"student_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python file")
    module = importlib.util.module_from_spec(spec)
    if set_globals is not None:
        set_globals(vars(module))
    sys.modules[spec.name] = module          # dataclasses and pickling look it up there
    spec.loader.exec_module(module)
    return module


def _finish() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(0)                            # no atexit handlers, no threads of the graded code


def child_main(argv: list[str]) -> None:
    """The child: load the grader, import the file, grade, report each step (see the module doc).
    Given ``REFERENCE`` for the file, it grades the package's own implementation instead (the
    parent's run to compare with)."""
    from course_pkg.labs.registry import LABS

    lab_name, path, attribute, fd, scenario_limit = argv
    token = sys.stdin.readline().strip()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)                    # the graded code reads nothing from the parent
    channel = _Channel(int(fd), token)
    lab = LABS[lab_name]
    grader = resolve(lab.grader_path)     # first: a kernel lab switches Triton to its interpreter
    for name in _modules_of_lab(lab):
        importlib.import_module(name)
    if path == REFERENCE:
        changes = _watch()
        channel.send("ready")
        channel.send("imported")
        _grade(grader, lab.reference, channel, changes, scenario_limit)
    path = Path(path).resolve()
    from_graded_file = authorship.graded_file_detector(path)
    protected = authorship.install_guards(authorship.written_parts(lab), from_graded_file)
    authorship.install_audit_hook(Path(__file__).resolve().parents[1], Path.cwd(), from_graded_file)
    changes = _watch()
    channel.send("ready")
    try:
        module = _load_module(path, from_graded_file.set_globals)
    except BaseException as e:  # noqa: BLE001 -- SystemExit and KeyboardInterrupt too
        where = traceback.extract_tb(e.__traceback__)[-1:]
        line = f" (line {where[0].lineno} of {Path(where[0].filename).name})" if where else ""
        exited = isinstance(e, SystemExit)
        channel.send("import_failed", message=(
            f"importing {path.name} raised {type(e).__name__}: {e}{line}"
            + ("; a file to grade must not exit when it is imported (put script code under "
               "if __name__ == \"__main__\":)" if exited else "")))
        _finish()
    changed = changes()
    if changed:
        channel.send("tampered", message=_tamper_message(changed))
        _finish()
    if not hasattr(module, attribute):
        channel.send("missing", message=f"{path.name} defines no {attribute!r} (name it so, or pass --name)")
        _finish()
    graded = getattr(module, attribute)
    borrowed = authorship.authorship_problems(lab, graded, protected)
    if borrowed:
        channel.send("borrowed", problems=borrowed)
        _finish()
    channel.send("imported")
    _grade(grader, graded, channel, changes, scenario_limit)


def _grade(grader, graded, channel: _Channel, changes, scenario_limit: str) -> None:
    g = ChildGrading(channel, changes, float(scenario_limit))
    try:
        grader(graded, g)
    except _Stop:
        _finish()
    except BaseException as e:  # noqa: BLE001 -- outside any scenario: the grading cannot go on
        channel.send("grader_error", message=f"the grader stopped outside a scenario: {type(e).__name__}: {e}")
        _finish()
    changed = changes()
    if changed:
        channel.send("tampered", message=_tamper_message(changed))
        _finish()
    channel.send("done", scenarios=len(g.scenarios), notes=list(g.notes))
    _finish()
