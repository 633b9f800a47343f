"""The set-up files agree with each other: pyproject, environment.yml, the lock file."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {Requirement(r).name.lower(): Requirement(r) for r in reqs}


def _environment_requirements() -> dict[str, Requirement]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    return {Requirement(r).name.lower(): Requirement(r) for r in pip if not r.startswith("-e")}


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    py, env = _pyproject_requirements(), _environment_requirements()
    assert sorted(py) == sorted(env), "environment.yml and pyproject.toml name different packages"
    for name in py:
        assert py[name].specifier == env[name].specifier, f"{name}: {py[name]} vs {env[name]}"
        assert py[name].marker == env[name].marker or str(py[name].marker) == str(env[name].marker), name


def test_environment_yml_pins_the_python_the_course_is_tested_on():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert "python=3.11" in env["dependencies"]


def test_lock_file_pins_every_dependency_within_its_range():
    lock = {}
    for line in (ROOT / "requirements-lock.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = re.split(r"==", line, maxsplit=1)
            lock[name.lower().replace("_", "-")] = version
    for name, req in _pyproject_requirements().items():
        key = name.replace("_", "-")
        assert key in lock, f"{name} is not pinned in requirements-lock.txt"
        assert req.specifier.contains(lock[key], prereleases=True), f"{name}=={lock[key]} outside {req.specifier}"
    assert lock["torch"] == "2.13.0", "the bootstrap must take this machine's local CPU build of torch"
