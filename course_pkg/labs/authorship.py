"""Who wrote the graded code: the command line's child keeps the package's answer out of reach.

A lab asks for the bodies of a few methods (or one function, or one kernel). The package holds
its own version of each, and a file that inherits, re-exports, delegates to or copies the
package's version would pass without a line written. In the grading child
(``course_pkg.labs.isolation``), before the student's file is imported:

* **the written parts are listed** (``written_parts``): the names the lab's stub defines,
  looked up on the package's class (``can_append`` and ``may_append`` on ``BlockManager`` for
  ``append``), or the package's function or kernel itself;
* **each is guarded** (``install_guards``): the package's method is replaced, on its class, by
  one that runs it as before when the grader or the package calls it, and raises
  ``ReferenceUnavailable`` when code of the graded file is on the call stack (``super()``, a
  call through the class, an instance of the package's class held by the file); a function
  is guarded under every name a package module gives it (``course_pkg.salt_hash`` is the function
  behind the static method ``BlockManager.salt_hash``);
* **its source is unreadable** (``install_audit_hook``): while code of the graded file runs,
  opening a source or bytecode file of a loaded package module raises ``PermissionError``
  (``inspect.getsource``, ``open``, ``importlib.reload``, a loader: they all open the file, and
  ``linecache`` gives the graded code none of its lines); so do writing outside the child's own
  temporary directory and starting a process.

"Code of the graded file" (``graded_file_detector``) is every frame that does not run in the
namespace of a loaded module from the package, the standard library or an installed package:
the file's own lines, and whatever it compiled from a string, under any file name.

After the import, ``authorship_problems`` looks at the graded object without running it: a
written part that is still the package's (inherited, assigned from the package, re-exported)
fails the file before any scenario runs, with the name of the part.

This is a classroom's honesty check, not a security boundary: code in one process can reach
anything in it (the unguarded functions through the closures of the guards, say).
"""
from __future__ import annotations

import inspect
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path

from course_pkg.labs.lab import Lab, resolve

#: Names every class body defines: never a part the student writes.
_CLASS_BOOKKEEPING = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
                      "__firstlineno__", "__static_attributes__"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
#: Audit events that change the file system at a path (the first argument), and those that start
#: a process.
_PATH_EVENTS = {"os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.chmod", "os.chown", "os.truncate",
                "os.utime", "os.rename", "os.symlink", "os.link", "shutil.copyfile", "shutil.move"}
_PROCESS_EVENTS = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                   "os.forkpty", "pty.spawn"}


class ReferenceUnavailable(RuntimeError):
    """Raised when the graded file calls the package's own version of what it was asked to write."""


@dataclass(frozen=True)
class Part:
    """One thing the student writes: attribute ``name`` of ``owner`` (a class or a module)."""

    owner: object
    name: str
    label: str                      # "BlockManager.can_append", "kv_block_bytes"


def code_of(value):
    """The code object behind a function, method, property or Triton kernel (None otherwise)."""
    for get in (lambda v: v.__code__, lambda v: v.__func__.__code__, lambda v: v.fget.__code__,
                lambda v: v.fn.__code__):
        try:
            code = get(value)
        except AttributeError:
            continue
        if isinstance(code, types.CodeType):
            return code
    return None


def _class_parts(stub: type, reference: type):
    for name, value in vars(stub).items():
        if name in _CLASS_BOOKKEEPING:
            continue
        if isinstance(value, type):             # a nested class (tensor_parallel's three layers)
            yield from _class_parts(value, getattr(reference, name))
            continue
        owner = next((k for k in reference.__mro__ if name in vars(k) and k is not object), None)
        if owner is not None:
            yield Part(owner, name, f"{owner.__qualname__}.{name}")


def written_parts(lab: Lab) -> list[Part]:
    """The package's versions of what lab ``lab`` asks for."""
    stub, reference = lab.stub, lab.reference
    if isinstance(stub, type):
        return list(_class_parts(stub, reference))
    parts = []
    for path in dict.fromkeys((lab.reference_path, *lab.solution_paths)):
        if "." in path.partition(":")[2]:
            continue                            # a method: the student calls it, does not write it
        obj = resolve(path)
        fn = getattr(obj, "fn", obj)            # a Triton kernel: its Python function
        module = sys.modules.get(getattr(fn, "__module__", None))
        name = getattr(fn, "__name__", None)
        if module is not None and vars(module).get(name) is obj:   # where it is defined
            parts.append(Part(module, name, name))
    return parts


def _stub_names(stub: type):
    """(name, nested names or None) for each part a class stub defines."""
    for name, value in vars(stub).items():
        if name not in _CLASS_BOOKKEEPING:
            yield name, (value if isinstance(value, type) else None)


# ---------------------------------------------------------------- the guards

def _guard(fn, label: str, from_graded_file):
    def guarded(*args, **kwargs):
        if from_graded_file(sys._getframe(1)):
            raise ReferenceUnavailable(
                f"the graded code called the package's own {label}, which is what this lab asks you to "
                "write: grading needs your code (no super(), no call through the package's class)")
        return fn(*args, **kwargs)

    guarded.__name__, guarded.__qualname__ = fn.__name__, fn.__qualname__
    guarded.__doc__, guarded.__module__ = fn.__doc__, fn.__module__
    return guarded


_GUARD_CODE = _guard(lambda: None, "", None).__code__       # every guard runs this code


def protected_code(parts: list[Part]) -> dict:
    """The code objects of the package's parts, with their names: a graded object made of one is
    not the student's."""
    found = {}
    for part in parts:
        code = code_of(inspect.getattr_static(part.owner, part.name))
        if code is not None:
            found[code] = part.label
    return found


def install_guards(parts: list[Part], from_graded_file) -> dict:
    """Guard each part in place; return the code objects a graded object must not be made of
    (the parts' own, and the guards')."""
    protected = protected_code(parts)
    for part in parts:
        value = inspect.getattr_static(part.owner, part.name)
        if isinstance(value, types.FunctionType):
            guarded = _guard(value, part.label, from_graded_file)
            setattr(part.owner, part.name, guarded)
            _rebind(value, guarded)
        elif isinstance(value, staticmethod):       # BlockManager.salt_hash: a module's function too
            guarded = _guard(value.__func__, part.label, from_graded_file)
            setattr(part.owner, part.name, staticmethod(guarded))
            _rebind(value.__func__, guarded)
        elif isinstance(value, property) and value.fget is not None:
            setattr(part.owner, part.name, property(_guard(value.fget, part.label, from_graded_file),
                                                    value.fset, value.fdel, value.__doc__))
        # A Triton kernel is left as it is: the static check below still refuses it re-exported.
    protected[_GUARD_CODE] = None                  # a guard: named by the part it stands for
    return protected


def _rebind(fn, guarded) -> None:
    """Every other name a loaded package module gives ``fn`` (``course_pkg.salt_hash``, the
    function behind ``BlockManager.salt_hash``) now names its guard."""
    for name, module in list(sys.modules.items()):
        if name == "course_pkg" or name.startswith("course_pkg."):
            for attr, value in list(vars(module).items()):
                if value is fn:
                    setattr(module, attr, guarded)


def _name_of(value) -> str:
    value = getattr(value, "fget", value)
    return getattr(value, "__qualname__", None) or getattr(getattr(value, "fn", None), "__qualname__", repr(value))


def _package_part(value, protected: dict) -> str | None:
    """The package part ``value`` is (by its code), or None when it is not one."""
    code = code_of(value)
    if code not in protected:
        return None
    return protected[code] or _name_of(value)


def authorship_problems(lab: Lab, graded, protected: dict) -> list[str]:
    """What in ``graded`` is the package's own code rather than the student's (by looking only)."""
    shown = _name_of(graded)
    part = _package_part(graded, protected) or (lab.reference_path.partition(":")[2] if graded is lab.reference
                                                else None)
    if part is not None:
        return [f"{shown} is the package's own {part}, not code of the graded file (re-exported or assigned): "
                "grading needs your own code"]
    stub = lab.stub
    if not (isinstance(stub, type) and isinstance(graded, type)):
        return []
    return list(_class_problems(stub, graded, shown, protected))


def _class_problems(stub: type, graded: type, shown: str, protected: dict):
    for name, nested in _stub_names(stub):
        try:
            value = inspect.getattr_static(graded, name)
        except AttributeError:
            yield f"{shown} has no {name!r}"
            continue
        if nested is not None:
            if isinstance(value, type):
                yield from _class_problems(nested, value, f"{shown}.{name}", protected)
            continue
        part = _package_part(value, protected)
        if part is not None:
            yield (f"{shown}.{name} is the package's own {part} (inherited, assigned or re-exported), "
                   "not code of the graded file: write it in your class")


# ---------------------------------------------------------------- the audit hook

def install_audit_hook(package_dir: Path, work_dir: Path, from_graded_file) -> None:
    """While code of the graded file is on the stack: no reading a loaded package module's source
    or bytecode, no writing outside ``work_dir``, no new process. (Audit hooks cannot be removed.)"""
    package_dir, work_dir = os.path.realpath(package_dir), os.path.realpath(work_dir)
    allowed_writes = (work_dir + os.sep, os.devnull)

    def loaded_module_file(path: str) -> bool:
        if not path.startswith(package_dir + os.sep):
            return False
        if "__pycache__" in path:
            try:
                import importlib.util
                path = importlib.util.source_from_cache(path)
            except ValueError:
                return True
        return any(getattr(m, "__file__", None) and os.path.realpath(m.__file__) == path
                   for name, m in list(sys.modules.items()) if name.startswith("course_pkg"))

    def hook(event: str, args) -> None:
        if event == "open":
            path = args[0]
            if isinstance(path, int) or path is None:
                return
            mode, flags = (args + (None, 0))[1:3]
            writing = bool(mode and any(c in mode for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
            if not from_graded_file(sys._getframe(1)):
                return
            real = os.path.realpath(os.fsdecode(path))
            if writing and not (real.startswith(allowed_writes[0]) or real == allowed_writes[1]):
                raise PermissionError(f"the graded code may write only inside its working directory "
                                      f"{work_dir}; it opened {real} for writing")
            if not writing and loaded_module_file(real):
                raise PermissionError(f"the package's source is not readable by the graded code ({real}): "
                                      "write your solution yourself")
        elif event in _PATH_EVENTS:
            if not from_graded_file(sys._getframe(1)):
                return
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)):
                    real = os.path.realpath(os.fsdecode(path))
                    if not real.startswith(allowed_writes[0]):
                        raise PermissionError(f"the graded code may change files only inside its working "
                                              f"directory {work_dir}; {event} on {real}")
        elif event in _PROCESS_EVENTS and from_graded_file(sys._getframe(1)):
            raise PermissionError(f"the graded code may not start processes ({event})")

    sys.addaudithook(hook)

    # inspect.getsource reads through linecache, which may hold a package file read earlier (by
    # Triton, or a traceback): from the graded file's frames it finds nothing there either.
    import linecache

    getlines = linecache.getlines

    def guarded_getlines(filename, module_globals=None):
        if from_graded_file(sys._getframe(1)) and loaded_module_file(os.path.realpath(filename)):
            return []
        return getlines(filename, module_globals)

    linecache.getlines = guarded_getlines


def trusted_directories() -> tuple[str, ...]:
    """Where the code that may call the package's parts lives: the package, the standard library,
    the installed packages (torch, Triton). Anything else on the stack is the graded file's."""
    import site
    import sysconfig

    dirs = {Path(__file__).resolve().parents[1], Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix),
            *(Path(p) for p in site.getsitepackages()), Path(site.getusersitepackages()),
            *(Path(p) for p in sysconfig.get_paths().values())}
    return tuple(sorted({os.path.realpath(d) + os.sep for d in dirs}))


def graded_file_detector(path: Path):
    """A function of a frame: is code of the graded file on the stack from there down?

    Trusted code runs in the namespace of a loaded module whose file is in a trusted directory
    (``trusted_directories``): the package, the standard library, torch, Triton -- code they
    compile at run time too (``dataclasses`` builds ``__init__`` with ``exec`` in the class's
    module). Every other frame is the graded file's: its own lines, and whatever it compiled
    from a string into a namespace of its own, under any file name. The frames that started the
    child are trusted. ``set_globals`` names the graded module's namespace once it exists."""
    filename = str(path)
    roots = trusted_directories()
    state = {"globals": None}
    trusted: set[int] = set()                 # ids of module namespaces found trusted (they live on)
    starting = set()
    frame = sys._getframe(1)
    while frame is not None:
        starting.add(frame.f_code)
        frame = frame.f_back

    def trusted_namespace(namespace: dict) -> bool:
        if id(namespace) in trusted:
            return True
        name = namespace.get("__name__")
        module = sys.modules.get(name) if isinstance(name, str) else None
        file = getattr(module, "__file__", None)
        if module is None or vars(module) is not namespace or not isinstance(file, str):
            return False
        if not os.path.realpath(file).startswith(roots):
            return False
        trusted.add(id(namespace))
        return True

    def graded(frame) -> bool:
        if frame.f_code.co_filename == filename or frame.f_globals is state["globals"]:
            return True
        return frame.f_code not in starting and not trusted_namespace(frame.f_globals)

    def from_graded_file(frame) -> bool:
        while frame is not None:
            if graded(frame):
                return True
            frame = frame.f_back
        return False

    def set_globals(namespace: dict) -> None:
        state["globals"] = namespace

    from_graded_file.set_globals = set_globals
    return from_graded_file
