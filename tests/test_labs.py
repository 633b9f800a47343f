"""The labs (course_pkg.labs): every reference passes, every stub and mutant fails, and says where.

A grader that accepts a mutant has a blind spot; one that rejects the package's own code, or a
correct solution written differently, tests something the contract does not say. Both are
checked here, with solutions written in this file independently of the package.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from course_pkg.block_manager import BlockManager
from course_pkg.labs import LABS, Solution, labs_of_chapter, show_solution, show_stub, source_of
from course_pkg.labs.hooks import PRIVATE_MEMBERS
from course_pkg.labs.lab import resolve
from course_pkg.scheduler import Scheduler
from course_pkg.sequence import Sequence, SequenceStatus

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = [(lab.name, mutant) for lab in LABS.values() for mutant in lab.mutant_paths]


def _assert_failures_name_their_scenario(report) -> None:
    assert report.failures, "a failing report without failures"
    for failure in report.failures:
        scenario = next((s for s in report.scenarios if failure.startswith(s + ": ")), None)
        assert scenario is not None, f"failure names no scenario of the lab: {failure!r}"
        assert len(failure) > len(scenario) + 10, f"failure does not say what differed: {failure!r}"


def test_registry_covers_every_chapter_with_enough_labs_and_mutants():
    assert len(LABS) >= 10
    chapters = {int(p.name[:2]) for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    for chapter in sorted({*range(1, 8), *(chapters & set(range(1, 11)))}):   # 01-07, and 08-10 once written
        assert labs_of_chapter(chapter), f"chapter {chapter:02d} has no lab"
    assert sum(len(lab.mutant_paths) for lab in LABS.values()) >= 16
    for lab in LABS.values():
        assert lab.mutant_paths, f"lab {lab.name} has no mutant"
        assert lab.title and lab.checks and lab.task


@pytest.mark.parametrize("name", list(LABS))
def test_the_reference_passes(name):
    lab = LABS[name]
    report = lab.grade(lab.reference)
    assert report.passed, str(report)
    assert report.scenarios and not report.failures


@pytest.mark.parametrize("name", list(LABS))
def test_the_stub_fails_and_every_failure_names_its_scenario(name):
    lab = LABS[name]
    report = lab.grade(lab.stub)
    assert not report.passed
    _assert_failures_name_their_scenario(report)
    assert str(report).startswith(f"lab {name}: FAILED")


@pytest.mark.parametrize(("name", "mutant"), MUTANTS, ids=[f"{n}-{m}" for n, m in MUTANTS])
def test_every_mutant_is_rejected_and_the_failure_names_its_scenario(name, mutant):
    lab = LABS[name]
    report = lab.grade(lab.mutants[mutant])
    assert not report.passed, f"mutant {mutant!r} of lab {name} passes: the grader has a blind spot"
    _assert_failures_name_their_scenario(report)


# The wrong implementations issue 18 found passing, each rejected in the scenario that tests its rule.
ISSUE_18_MUTANTS = [
    ("logical_blocks", "block(-1) returns []", "16 tokens, block size 16", "block(-1) must raise IndexError"),
    ("allocate", "never counts prefix_cache_stats",
     "prefix_cache_stats: first admissions and readmissions counted apart", "expected (1, 10, 0, 0, 0, 0), got (0, 0, 0"),
    ("allocate", "readmissions counted as first admissions",
     "prefix_cache_stats: first admissions and readmissions counted apart",
     "after B's readmission: the preempted_* counters only: expected (2, 21, 8, 1, 11, 8), got (3, 32, 16, 0, 0, 0)"),
    ("allocate", "room check ignores revived blocks", "revived blocks count against the room",
     "allocate(B, 2) raised as it must, but changed free queue"),
    ("free_queue", "popleft is list.pop(0) (O(n))", "popleft, append and remove cost the same", "popleft is "),
    ("fork_cow", "fork never checks the child is a copy", "misuse is refused and changes nothing",
     "fork(A, Z) must raise"),
]


@pytest.mark.parametrize(("name", "mutant", "scenario", "what"), ISSUE_18_MUTANTS,
                         ids=[f"{n}-{m}" for n, m, _, _ in ISSUE_18_MUTANTS])
def test_the_wrong_implementations_of_issue_18_fail_in_their_scenario(name, mutant, scenario, what):
    report = LABS[name].grade(LABS[name].mutants[mutant])
    failure = next((f for f in report.failures if f.startswith(scenario)), None)
    assert failure is not None and what in failure, report.failures


# ------------------------------------------------------------------ correct solutions, written independently

class ScratchScheduler(Scheduler):
    """_schedule_decodes and preempt written from chapter 06's rules, with plain changes."""

    def _schedule_decodes(self, plan):
        count = i = 0
        while i < len(self.running) and count < self.max_num_batched_tokens:
            seq = self.running[i]
            while seq in self.running and not self.block_manager.can_append(seq):
                self.preempt(self.running[-1], plan)
            if seq not in self.running:           # it gave up its own blocks: nobody is left after it
                break
            plan.blocks_to_copy += self.block_manager.may_append(seq)
            self._schedule_tokens(plan, seq, 1, decode=True)
            count += 1
            i += 1
        return count

    def preempt(self, seq, plan):
        seq.status = self._release_victim(seq, plan)
        self.running.remove(seq)
        seq.num_scheduled_tokens = 0
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)








def _kernel_lab(attr):
    return getattr(importlib.import_module("course_pkg.labs.kernel_labs"), attr)


#: One file per lab in tests/lab_solutions/, each defining the stub's name, as a student's file would.
SOLUTION_FILES = sorted((ROOT / "tests" / "lab_solutions").glob("*.py"))


def _solution_from_file(path: Path):
    spec = importlib.util.spec_from_file_location(f"lab_solution_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, LABS[path.stem].stub_path.rpartition(":")[2])


@pytest.mark.parametrize("path", SOLUTION_FILES, ids=lambda p: p.stem)
def test_a_correct_solution_written_independently_passes(path):
    report = LABS[path.stem].grade(_solution_from_file(path))
    assert report.passed, str(report)


def test_every_block_lab_has_a_solution_file():
    kept_here = {"scheduler", "mixed", "store_kvcache", "paged_attention"}     # solved in this file, or not yet
    assert {p.stem for p in SOLUTION_FILES} == set(LABS) - kept_here


@pytest.mark.parametrize(("name", "solution"), [
    ("scheduler", lambda: ScratchScheduler),
    ("store_kvcache", lambda: _kernel_lab("store_lab_shaped")),        # a kernel of the lab's shape
    ("paged_attention", lambda: _kernel_lab("decode_lab_shaped")),
])
def test_a_correct_solution_written_differently_passes(name, solution):
    report = LABS[name].grade(solution())
    assert report.passed, str(report)


# ------------------------------------------------------------------ the measured gates

@pytest.mark.parametrize(("mutant", "op"), [("deque.remove (O(n))", "remove"), ("popleft is list.pop(0) (O(n))", "popleft"),
                                           ("append scans the queue (O(n))", "append")])
def test_the_free_queue_gate_alone_rejects_an_o_n_operation(mutant, op):
    report = LABS["free_queue"].grade(LABS["free_queue"].mutants[mutant])
    assert len(report.failures) == 1, report.failures
    assert report.failures[0].startswith("popleft, append and remove cost the same at 1,000 and 100,000 blocks: "
                                          f"{op} is "), report.failures
    assert [o for o in ("popleft", "append", "remove") if f"{o} is " in report.failures[0]] == [op]
    assert len(re.findall(r"ratio \d+\.\d+", " ".join(report.notes))) == 3


def test_the_prefix_caching_lab_reports_the_saving_and_requires_the_references():
    lab = LABS["prefix_caching"]
    note = " ".join(lab.grade(lab.reference).notes)
    saved, total, reference = map(int, re.search(r"saves (\d+) of (\d+) prefill tokens \(the reference saves (\d+)\)",
                                                 note).groups())
    assert saved == reference and 0 < saved < total
    # Registering at allocation "saves" more -- by hitting blocks whose K/V do not exist yet.
    report = lab.grade(lab.mutants["hashes registered at allocation"])
    assert any(f.startswith("prefill tokens saved") for f in report.failures)


# ------------------------------------------------------------------ private members, display, CLI

def test_every_private_member_the_labs_name_is_listed_in_hooks_and_exists():
    for (owner, member), where in PRIVATE_MEMBERS.items():
        obj = resolve(owner) if ":" in owner else importlib.import_module(owner)
        if obj is BlockManager:
            obj = BlockManager(1, 1)                          # instance attributes count
        assert hasattr(obj, member), \
            f"{owner}.{member} (used by {where}) no longer exists: adapt course_pkg/labs/hooks.py and its users"
    listed = {member for _, member in PRIVATE_MEMBERS}
    package_privates = set()
    for owner in ("course_pkg.block_manager:BlockManager", "course_pkg.scheduler:Scheduler",
                  "course_pkg.block:Block", "course_pkg.sequence:Sequence"):
        package_privates |= {m for m in dir(resolve(owner)) if m.startswith("_") and not m.startswith("__")}
    for instance in (BlockManager(1, 1), Sequence([1], block_size=1)):      # attributes set in __init__ too
        package_privates |= {m for m in vars(instance) if m.startswith("_") and not m.startswith("__")}
    package_privates |= {m for m in vars(importlib.import_module("course_pkg.kernels.triton_kernels"))
                         if m.startswith("_") and not m.startswith("__")}
    for path in (ROOT / "course_pkg" / "labs").rglob("*.py"):
        used = set(re.findall(r"\b(_[a-z][a-z0-9_]*)\b", path.read_text())) & package_privates
        assert used <= listed, f"{path.name} names private members not listed in hooks.py: {sorted(used - listed)}"


def test_stub_and_solution_display():
    code = show_stub("append")
    assert "def can_append" in code.data and "..." in code.data
    solution = show_solution("append")
    assert isinstance(solution, Solution)
    assert repr(solution) == "\n".join(source_of(o) for o in LABS["append"].solution).rstrip()
    assert "<details>" in solution._repr_html_() and "can_append" in solution._repr_html_()
    assert "def student_paged_decode_kernel" in show_stub("paged_attention").data


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "course_pkg.labs", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_cli_lists_every_lab_and_grades_a_file(tmp_path):
    listing = _cli("list")
    assert listing.returncode == 0, listing.stderr
    for lab in LABS.values():
        assert re.search(rf"^{lab.name}\s+chapter {lab.chapter:02d}", listing.stdout, re.M), lab.name
    good = tmp_path / "good.py"
    good.write_text(textwrap.dedent("""
        def student_internal_fragmentation(num_tokens, block_size):
            return sum(-n % block_size for n in num_tokens)
    """))
    bad = tmp_path / "bad.py"
    bad.write_text("def frag(num_tokens, block_size):\n    return 0\n")
    passed = _cli("fragmentation", str(good))
    assert passed.returncode == 0 and "lab fragmentation: PASSED" in passed.stdout, passed.stdout + passed.stderr
    failed = _cli("fragmentation", str(bad), "--name", "frag")
    assert failed.returncode == 1 and "one token in a block of 16: internal_fragmentation([1], 16)" in failed.stdout
    missing = _cli("fragmentation", str(bad))
    assert missing.returncode == 1 and "defines no 'student_internal_fragmentation'" in missing.stdout
    unknown = _cli("no_such_lab", str(good))
    assert unknown.returncode == 2 and "no lab named" in unknown.stderr


# The command line grades in a child process it can kill: a file that exits, crashes, loops, swallows
# the timeout or patches the grader fails, with a message, within its limits. (Short limits keep these fast.)
_SEQ = "from course_pkg.sequence import Sequence\n"
_METHOD = _SEQ + ("class StudentSequence(Sequence):\n"          # right but for num_blocks, written last
                  "    def block(self, i):\n        if not 0 <= i < -(-self.num_tokens // self.block_size):\n"
                  "            raise IndexError(i)\n        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]\n"
                  "    @property\n    def last_block_num_tokens(self):\n        return (self.num_tokens - 1) % self.block_size + 1\n"
                  "    @property\n    def num_blocks(self):\n")
CLI_CASES = {
    "sys.exit(0) at import": (_SEQ + "class StudentSequence(Sequence): pass\nimport sys\nsys.exit(0)\n",
                              "importing case.py raised SystemExit: 0 (line 4 of case.py); a file to grade must not exit"),
    "os._exit(0) at import": (_SEQ + "class StudentSequence(Sequence): pass\nimport os\nos._exit(0)\n",
                              "the grading process ended while importing case.py (exit status 0)"),
    "KeyboardInterrupt at import": (_SEQ + "raise KeyboardInterrupt\n", "importing case.py raised KeyboardInterrupt"),
    "sys.exit(0) in a method": (_METHOD + "        import sys; sys.exit(0)\n",
                                "1 token, block size 1: raised SystemExit: 0 (graded code must return, not exit)"),
    "os._exit(0) in a method": (_METHOD + "        import os; os._exit(0)\n",
                                "1 token, block size 1: the grading process ended during this scenario (exit status 0)"),
    "a crash in a method": (_METHOD + "        import os, signal; os.kill(os.getpid(), signal.SIGSEGV)\n",
                            "the grading process ended during this scenario (killed by SIGSEGV)"),
    "KeyboardInterrupt in a method": (_METHOD + "        raise KeyboardInterrupt\n",
                                      "1 token, block size 1: raised KeyboardInterrupt (raised by the code under test)"),
    "Grading patched at import": ("from course_pkg.labs.lab import Grading\nGrading.fail = lambda self, what: None\n"
                                  + _METHOD + "        return 0\n", "course_pkg.labs.lab.Grading.fail was replaced"),
    "Lab.grade patched at import": ("from course_pkg.labs.lab import Lab, LabReport\n"
                                    "Lab.grade = lambda self, impl: LabReport(self.name, True, [])\n"
                                    + _METHOD + "        return 0\n", "course_pkg.labs.lab.Lab.grade was replaced"),
    "Grading patched in a method": (_METHOD + "        from course_pkg.labs.lab import Grading\n"
                                    "        Grading.equal = lambda *args: None\n        return 0\n",
                                    "1 token, block size 1: the graded code changed the grader"),
    "a forged report": ("import os\nfor fd in range(3, 30):\n    try:\n        os.write(fd, b'{\"event\": \"done\"}\\n')\n"
                        "    except OSError:\n        pass\n" + _SEQ + "class StudentSequence(Sequence): pass\n",
                        "the grading channel received a message the grader did not send"),
    "an endless import": ("while True:\n    pass\n", "importing case.py did not finish within 1 s"),
    "an endless method": (_METHOD + "        while True:\n            pass\n",
                          "2 scenarios ran past their 1 s of CPU time: the scenarios after '5 tokens, block size 1' were not run"),
    "a swallowed timeout": (_METHOD + "        while True:\n            try:\n                while True:\n"
                            "                    pass\n            except BaseException:\n                pass\n",
                            "1 token, block size 1: still running after 5.1 s: the code under test did not stop"),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_fails_a_file_that_exits_crashes_loops_or_patches_the_grader(case, tmp_path):
    source, message = CLI_CASES[case]
    path = tmp_path / "case.py"
    path.write_text(source)
    start = time.monotonic()
    result = _cli("logical_blocks", str(path), "--import-limit", "1", "--scenario-limit", "1")
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith("lab logical_blocks: FAILED") and "PASSED" not in result.stdout, result.stdout
    assert message in result.stdout, result.stdout
    assert elapsed < 15, f"{case}: {elapsed:.1f} s"


def test_cli_patching_lockstep_fails_and_json_has_one_record_per_scenario(tmp_path):
    path = tmp_path / "case.py"
    path.write_text("from course_pkg.labs import lockstep\nlockstep.Lockstep.compare = lambda self, label: None\n"
                    "from course_pkg.block import Block\nclass StudentBlock(Block):\n    def reset(self):\n"
                    "        self.ref_count = 0\n")
    patched = _cli("block_reset", str(path))
    assert patched.returncode == 1 and "course_pkg.labs.lockstep.Lockstep.compare was replaced" in patched.stdout
    path.write_text(_METHOD + "        return self.num_tokens // self.block_size + 1\n")
    result = _cli("logical_blocks", str(path), "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"] == "FAILED" and report["passed"] is False and report["problems"] == []
    by_name = {r["name"]: r for r in report["scenarios"]}
    assert len(by_name) == len(report["scenarios"]) == 9
    assert by_name["16 tokens, block size 16"] == {"name": "16 tokens, block size 16", "passed": False,
                                                   "message": "num_blocks: expected 1, got 2",
                                                   "seconds": by_name["16 tokens, block size 16"]["seconds"]}
    assert by_name["1 token, block size 16"]["passed"] is True     # 1 // 16 + 1 == 1: right by chance
    path.write_text(_METHOD + "        return -(-self.num_tokens // self.block_size)\n")
    good = _cli("logical_blocks", str(path), "--json")
    assert good.returncode == 0 and json.loads(good.stdout)["verdict"] == "PASSED", good.stdout
    assert len(json.loads(good.stdout)["scenarios"]) == 9 and all(r["passed"] for r in json.loads(good.stdout)["scenarios"])


# ------------------------------------------------------------------ authorship and a confirmed verdict

def test_every_lab_knows_what_it_asks_for_and_refuses_the_packages_own():
    """By looking only: the stub and the independent solutions are the student's code; the
    reference, and for a class an empty subclass of it, are the package's, part by part."""
    from course_pkg.labs.authorship import authorship_problems, protected_code, written_parts

    solutions = {p.stem: _solution_from_file(p) for p in SOLUTION_FILES}
    for lab in LABS.values():
        parts = written_parts(lab)
        assert parts, lab.name
        protected = protected_code(parts)
        assert authorship_problems(lab, lab.stub, protected) == [], lab.name
        assert authorship_problems(lab, lab.reference, protected), lab.name
        if lab.name in solutions:
            assert authorship_problems(lab, solutions[lab.name], protected) == [], lab.name
        if isinstance(lab.reference, type):
            problems = authorship_problems(lab, type("Empty", (lab.reference,), {}), protected)
            assert len(problems) == len(parts), (lab.name, problems)
            assert all("is the package's own" in p for p in problems), problems


_AUTHOR = _SEQ + "class StudentSequence(Sequence):\n"
AUTHORSHIP_CASES = {
    "a re-export": ("from course_pkg.sequence import Sequence as StudentSequence\n",
                    "Sequence is the package's own Sequence, not code of the graded file"),
    "an empty subclass": (_AUTHOR + "    pass\n", "StudentSequence.num_blocks is the package's own Sequence.num_blocks"),
    "super()": (_METHOD + "        return super().num_blocks\n",
                "1 token, block size 1: raised ReferenceUnavailable: the graded code called the package's own "
                "Sequence.num_blocks"),
    "a package instance held": (_METHOD + "        return Sequence(list(self.token_ids), block_size=self.block_size).num_blocks\n",
                                "raised ReferenceUnavailable: the graded code called the package's own Sequence.num_blocks"),
    "super() from code compiled under another file name": (
        "import json\n"
        "SOURCE = ('from course_pkg.sequence import Sequence\\n'\n"
        "          'class S(Sequence):\\n'\n"
        "          '    def block(self, i):\\n        return super().block(i)\\n'\n"
        "          '    @property\\n    def last_block_num_tokens(self):\\n        return super().last_block_num_tokens\\n'\n"
        "          '    @property\\n    def num_blocks(self):\\n        return super().num_blocks\\n')\n"
        "namespace = {'__name__': 'json'}\n"
        "exec(compile(SOURCE, json.__file__, 'exec'), namespace)\n"
        "StudentSequence = namespace['S']\n",
        "raised ReferenceUnavailable: the graded code called the package's own Sequence."),
    "the source exec'd": ("import inspect\nimport course_pkg.sequence as m\nexec(inspect.getsource(m))\n",
                          "importing case.py raised OSError: could not get source code"),
    "the source read from disk": ("import course_pkg.sequence as m\nexec(open(m.__file__).read())\n",
                                  "the package's source is not readable by the graded code"),
    "a write beside itself": ("open(__file__ + '.out', 'w').write('x')\n" + _METHOD + "        return 0\n",
                              "the graded code may write only inside its working directory"),
    "a process started": ("import subprocess\nsubprocess.run(['true'])\n" + _METHOD + "        return 0\n",
                          "the graded code may not start processes (subprocess.Popen)"),
    "failures silenced through gc": (
        "import gc\nclass Mute(list):\n    def append(self, x):\n        pass\n" + _METHOD
        + "        for o in gc.get_objects():\n            if type(o).__name__ == 'ChildGrading':\n"
          "                o.failures = Mute()\n        return 0\n",
        "1 token, block size 1: reported as passed, but the checks it made are not those the package's own run "
        "of it makes"),
    "a forged report, then os._exit(0)": (
        "import gc, os\n" + _METHOD
        + "        ch = next(o for o in gc.get_objects() if type(o).__name__ == '_Channel')\n"
          "        names = ['1 token, block size 1', '5 tokens, block size 1', '1 token, block size 16',\n"
          "                 '16 tokens, block size 16', '17 tokens, block size 16', '14 tokens, block size 7',\n"
          "                 '15 tokens, block size 7', '13 tokens, block size 7', 'growing by decode (block size 3)']\n"
          "        for i, n in enumerate(names):\n"
          "            if i:\n                ch.send('start', scenario=n)\n"
          "            ch.send('end', scenario=n, failure=None, seconds=0.0, checks=3, digest='0' * 64)\n"
          "        ch.send('done', scenarios=len(names), notes=[])\n        os._exit(0)\n",
        "growing by decode (block size 3): reported as passed, but the checks it made are not those"),
}


@pytest.mark.parametrize("case", list(AUTHORSHIP_CASES))
def test_cli_grades_only_the_files_own_code_and_confirms_every_pass(case, tmp_path):
    source, message = AUTHORSHIP_CASES[case]
    path = tmp_path / "case.py"
    path.write_text(source)
    result = _cli("logical_blocks", str(path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith("lab logical_blocks: FAILED") and "PASSED" not in result.stdout, result.stdout
    assert message in result.stdout, result.stdout
    assert not (tmp_path / "case.py.out").exists()


SALT_FILE = ("import course_pkg, hashlib\nfrom course_pkg import BlockManager\n\n"
             "class StudentSaltBlockManager(BlockManager):\n"
             "    @staticmethod\n    def salt_hash(cache_salt):\n        return {body}\n\n"
             "    def _confirms_hit(self, block, token_ids, parent_prefix_id, cache_salt=None):\n"
             "        return (block.token_ids == token_ids and block.parent_prefix_id == parent_prefix_id\n"
             "                and block.cache_salt == cache_salt)\n")


@pytest.mark.parametrize(("body", "passes"), [
    ("-1 if cache_salt is None else int.from_bytes(hashlib.sha256(cache_salt.encode()).digest()[:8], 'big')", True),
    ("course_pkg.salt_hash(cache_salt)", False),                         # the package's, under its export
    ("BlockManager.salt_hash(cache_salt)", False),                       # the package's, through the class
])
def test_cli_guards_a_static_method_part_under_every_name_the_package_gives_it(body, passes, tmp_path):
    path = tmp_path / "salt.py"
    path.write_text(SALT_FILE.format(body=body))
    result = _cli("cache_salt", str(path))
    assert (result.returncode == 0) == passes, result.stdout + result.stderr
    if not passes:
        assert "called the package's own BlockManager.salt_hash" in result.stdout, result.stdout


def test_cli_refuses_the_packages_kernel_under_the_stubs_name(tmp_path):
    path = tmp_path / "kernel.py"
    path.write_text("from course_pkg.kernels.triton_kernels import _store_kvcache_kernel as student_store_kvcache_kernel\n")
    result = _cli("store_kvcache", str(path))
    assert result.returncode == 1 and "is the package's own _store_kvcache_kernel" in result.stdout, result.stdout


def test_cli_runs_the_file_in_a_temporary_directory_of_its_own(tmp_path):
    path = tmp_path / "case.py"
    path.write_text("import os\nopen('scratch.txt', 'w').write(os.getcwd())\nprint('cwd', os.getcwd())\n"
                    + _METHOD + "        return -(-self.num_tokens // self.block_size)\n")
    result = _cli("logical_blocks", str(path), "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["verdict"] == "PASSED", result.stdout
    work = Path(report["output"][0].removeprefix("cwd "))
    assert work.name.startswith("course-lab-") and not work.exists()      # written there, removed after
    assert not (ROOT / "scratch.txt").exists() and not (tmp_path / "scratch.txt").exists()


def test_the_childs_watch_flags_replacements_and_shadowing_not_new_names():
    """What the CLI's child counts as a patched grader: a replaced or deleted attribute, a name
    added to a class, a module name that shadows a builtin -- not other new module names (Triton's
    interpreter adds dozens to a kernel's module while it runs one)."""
    import course_pkg.labs.lockstep as lockstep_module
    from course_pkg.labs.isolation import _watch
    from course_pkg.labs.lockstep import Lockstep

    changes = _watch()
    assert changes() == []
    saved = Lockstep.compare
    try:
        lockstep_module.some_helper = object()                # harmless: nothing looks it up
        assert changes() == []
        Lockstep.compare = lambda self, label: None
        Lockstep.extra = 1
        lockstep_module.len = lambda x: 0
        assert sorted(changes()) == ["course_pkg.labs.lockstep.Lockstep.compare was replaced",
                                     "course_pkg.labs.lockstep.Lockstep.extra was added",
                                     "course_pkg.labs.lockstep.len was added"]
    finally:
        Lockstep.compare = saved
        del Lockstep.extra, lockstep_module.len, lockstep_module.some_helper
    assert changes() == []


def test_a_scenario_is_limited_by_cpu_time_and_by_a_wider_wall_clock_bound():
    """A busy machine slows a scenario without using its budget: the limit is CPU time (and
    WALL_FACTOR times it in wall-clock time, for code that waits)."""
    from course_pkg.labs.lab import WALL_FACTOR, Grading

    g = Grading(time_limit=0.3)
    start = time.monotonic()
    with g.scenario("sleeps 0.5 s: no CPU time"):
        time.sleep(0.5)
    with g.scenario("spins"):
        while True:
            pass
    with g.scenario("sleeps for ever"):
        while True:
            time.sleep(0.05)
    assert g.scenarios == ["sleeps 0.5 s: no CPU time", "spins", "sleeps for ever"]
    assert len(g.failures) == 2, g.failures
    assert g.failures[0].startswith("spins: raised ScenarioTimeout: still running after 0.3 s of CPU time")
    assert g.failures[1].startswith(f"sleeps for ever: raised ScenarioTimeout: still running after "
                                    f"{WALL_FACTOR * 0.3:g} s (waiting")
    assert time.monotonic() - start < 0.5 + 0.3 * 3 + WALL_FACTOR * 0.3 + 1


def test_in_notebook_grading_records_exits_and_a_raised_scenario_failed_as_failures():
    import sys as _sys

    from course_pkg.labs.lab import ScenarioFailed

    class Exits(Sequence):
        @property
        def num_blocks(self):
            _sys.exit(0)

    class EndsTheScenario(Sequence):
        @property
        def num_blocks(self):
            raise ScenarioFailed

    for impl, what in ((Exits, "raised SystemExit: 0"), (EndsTheScenario, "raised ScenarioFailed")):
        report = LABS["logical_blocks"].grade(impl)
        assert not report.passed and all(what in f for f in report.failures[:8]), report.failures


def test_misuse_of_the_registry_is_named():
    with pytest.raises(KeyError, match="no lab named 'nope'"):
        show_stub("nope")
    with pytest.raises(KeyError, match="the labs are: block_reset"):
        show_solution("nope")


# ------------------------------------------------------------------ build first: the lab before the body

#: Chapters built lab first: no cell before a lab's section shows the body the lab asks for.
#: Every chapter with a lab (test_every_chapter_with_a_lab_is_built_first keeps it so).
BUILD_FIRST_CHAPTERS = ("01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "12", "13", "14",
                        "15", "16")


def _given_helpers(lab) -> set[str]:
    """Names the stub tells the student to call (``self._confirms_hit(...)``): tools the lab
    hands out, not bodies it asks for -- the chapter may show them before the lab."""
    import inspect

    stub = lab.stub
    source = inspect.getsource(getattr(stub, "fn", stub))
    defined = set(re.findall(r"def (\w+)\(", source))
    return {name for name in re.findall(r"(?<![\w.])(?:self\.)?(\w+)\(", source) if name not in defined}


def _body_lines(lab) -> list[tuple[str, list[str]]]:
    """Per function the lab asks for (each method of a class, a Triton kernel's Python function):
    its statements' lines, without the docstring, comments, lines too short to tell one function
    from another and lines found elsewhere in its module. Helpers the stub hands out
    (``_given_helpers``) are left out."""
    import ast
    import inspect

    functions = []
    for obj in lab.solution:
        obj = getattr(obj, "fget", obj)
        obj = getattr(obj, "fn", obj)                     # a @triton.jit kernel: its Python function
        members = vars(obj).values() if isinstance(obj, type) else [obj]
        functions += [getattr(m, "fget", m) for m in members if inspect.isfunction(getattr(m, "fget", m))]
    given = _given_helpers(lab)
    units = []
    for fn in functions:
        if fn.__name__ in given:
            continue
        source = textwrap.dedent(inspect.getsource(fn))
        node = ast.parse(source).body[0]
        body = node.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            body = body[1:]
        lines = source.splitlines()[body[0].lineno - 1:node.end_lineno] if body else []
        # A line found elsewhere in its module (a guard such as ``self._check_holder(seq)``, a
        # field the constructor sets the same way) tells nothing about this function's body.
        module_lines = Counter(line.strip() for line in inspect.getsource(inspect.getmodule(fn)).splitlines())
        lines = [line.strip() for line in lines if len(line.strip()) >= 12 and not line.strip().startswith("#")
                 and module_lines[line.strip()] == 1]
        # Two lines, or one long enough to be the whole answer (a one-line formula).
        if len(lines) >= 2 or (lines and len(lines[0]) >= 30):
            units.append((fn.__qualname__, lines))
    return units


def _shown(cell) -> str:
    """What a reader sees of a cell: its source and its text outputs."""
    text = [cell.source]
    for output in cell.get("outputs", []):
        text.append(output.get("text", ""))
        text.append(output.get("data", {}).get("text/plain", ""))
    return "\n".join(text)


def _revealed(cell, units) -> list[str]:
    """The functions of ``units`` whose body the cell shows (at least half of its lines)."""
    text = _shown(cell)
    return [name for name, lines in units if sum(line in text for line in lines) * 2 >= len(lines)]


def _is_lab(cell) -> bool:
    return "lab" in cell.get("metadata", {}).get("tags", [])


def _build_first_problems(cells, chapter: str) -> list[str]:
    """What breaks "build first" in a chapter's cells: a cell before a lab's section that shows
    the body the lab asks for, or a lab whose section is not followed at once by the package's
    code (a heading may come between)."""
    problems = []
    for lab in labs_of_chapter(int(chapter)):
        units = _body_lines(lab)
        if not units:
            problems.append(f"lab {lab.name}: no body to look for")
            continue
        task = f"lab-{chapter}-{lab.name}-task".replace("_", "-")
        start = next((i for i, c in enumerate(cells) if c.get("id") == task), None)
        if start is None:
            problems.append(f"lab {lab.name}: no section (cell {task})")
            continue
        if start and cells[start - 1].get("id") == f"lab-{chapter}-intro":
            start -= 1
        early = [(i, _revealed(c, units)) for i, c in enumerate(cells[:start])]
        if [e for e in early if e[1]]:
            problems.append(f"lab {lab.name}: cells before its section show its body: {[e for e in early if e[1]]}")
        end = start + 1 + next((i for i, c in enumerate(cells[start + 1:]) if not _is_lab(c)), len(cells))
        after = [i for i, c in enumerate(cells[end:], end) if _revealed(c, units) and not _is_lab(c)]
        if not (after and after[0] == end + (cells[end].cell_type == "markdown")):
            problems.append(f"lab {lab.name}: the package's code is not shown right after the lab (cells {after})")
    return problems


def _chapter_cells(chapter: str):
    import nbformat

    [path] = (ROOT / "notebooks").glob(f"{chapter}_*.ipynb")
    return nbformat.read(path, as_version=4).cells


def test_every_chapter_with_a_lab_is_built_first():
    assert sorted({f"{lab.chapter:02d}" for lab in LABS.values()}) == sorted(BUILD_FIRST_CHAPTERS)


@pytest.mark.parametrize("chapter", BUILD_FIRST_CHAPTERS)
def test_no_cell_before_a_lab_section_shows_the_body_the_lab_asks_for(chapter):
    problems = _build_first_problems(_chapter_cells(chapter), chapter)
    assert not problems, problems


@pytest.mark.parametrize("chapter", BUILD_FIRST_CHAPTERS)
def test_the_structure_check_fails_when_a_body_is_shown_before_its_lab(chapter):
    # The check must be able to fail: move the first cell that reveals each lab's body to the
    # top of the chapter (the old order, solution first) and it names that lab.
    cells = _chapter_cells(chapter)
    for lab in labs_of_chapter(int(chapter)):
        units = _body_lines(lab)
        reveal = next(i for i, c in enumerate(cells) if not _is_lab(c) and _revealed(c, units))
        moved = [cells[reveal]] + cells[:reveal] + cells[reveal + 1:]
        problems = _build_first_problems(moved, chapter)
        assert any(p.startswith(f"lab {lab.name}: cells before its section show its body") for p in problems), problems


# ------------------------------------------------------------------ tools/add_lab_sections.py

def _load_tool():
    spec = importlib.util.spec_from_file_location("add_lab_sections", ROOT / "tools" / "add_lab_sections.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_add_lab_sections_inserts_before_the_summary_touches_nothing_else_and_is_idempotent(tmp_path):
    import nbformat

    tool = _load_tool()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# 02 · Title"), nbformat.v4.new_code_cell("x = 1"),
                nbformat.v4.new_markdown_cell("## Summary and what comes next\n\ntext"),
                nbformat.v4.new_markdown_cell("## References")]
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="kept\n")]
    path = tmp_path / "02_block_manager.ipynb"
    nbformat.write(nb, path)
    assert tool.update(path) is True
    cells = nbformat.read(path, as_version=4).cells
    tagged = [i for i, c in enumerate(cells) if "lab" in c.metadata.get("tags", [])]
    assert tagged == list(range(2, 2 + len(tagged))) and cells[tagged[-1] + 1].source.startswith("## Summary")
    assert cells[1].outputs[0]["text"] == "kept\n" and cells[-1].source == "## References"
    sources = "\n".join(cells[i].source for i in tagged)
    for lab in labs_of_chapter(2):
        assert f'grade("{lab.name}", ' in sources and f'show_solution("{lab.name}")' in sources
    before = path.read_text()
    assert tool.update(path) is False and path.read_text() == before      # up to date: untouched
    # A stale section (a lab's text changed) is replaced, wherever it was.
    nb = nbformat.read(path, as_version=4)
    nb.cells[tagged[1]].source = "### an old title"
    nb.cells.append(nb.cells.pop(tagged[0]))
    nbformat.write(nb, path)
    assert tool.update(path) is True and path.read_text() == before


def test_add_lab_sections_puts_a_lab_just_before_the_cell_that_reveals_its_body(tmp_path):
    import nbformat

    tool = _load_tool()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# 03 · Title"), nbformat.v4.new_markdown_cell("## 1. The idea"),
                nbformat.v4.new_code_cell("show_source(FreeBlockQueue)", metadata={"tags": ["reveals-free_queue"]}),
                nbformat.v4.new_markdown_cell("## Summary"), nbformat.v4.new_markdown_cell("## References")]
    path = tmp_path / "03_lru.ipynb"
    nbformat.write(nb, path)
    assert tool.update(path) is True
    cells = nbformat.read(path, as_version=4).cells
    ids = [c.get("id") for c in cells]
    reveal = next(i for i, c in enumerate(cells) if "reveals-free_queue" in c.metadata.get("tags", []))
    # intro + free_queue's four cells right before the reveal; release_order's before the summary
    assert ids[reveal - 5:reveal] == ["lab-03-intro", "lab-03-free-queue-task", "lab-03-free-queue-stub",
                                      "lab-03-free-queue-grade", "lab-03-free-queue-solution"]
    assert ids[reveal + 1:reveal + 5] == ["lab-03-release-order-task", "lab-03-release-order-stub",
                                          "lab-03-release-order-grade", "lab-03-release-order-solution"]
    assert cells[reveal + 5].source == "## Summary"
    intro = cells[reveal - 5].source
    assert "before you read it" in intro and "(`release_order`) comes later in the chapter" in intro
    assert cells[reveal - 3].source.startswith("from course_pkg.labs import grade")   # imports with the first lab
    before = path.read_text()
    assert tool.update(path) is False and path.read_text() == before


def test_add_lab_sections_refuses_a_notebook_without_a_summary(tmp_path):
    import nbformat

    tool = _load_tool()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# 03 · Title")]
    path = tmp_path / "03_x.ipynb"
    nbformat.write(nb, path)
    before = path.read_text()
    with pytest.raises(SystemExit, match="no markdown cell with a 'Summary' heading"):
        tool.update(path)
    assert path.read_text() == before
