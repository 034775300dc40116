"""Where the program's own code was: the line a failure report and a hang report name.

The innermost frame outside mtrain, the installed libraries and the standard library, as
``file:line in function`` (``file`` relative to the current folder when under it).  The rank
wrapper's ExitRecord, the runtime's PhaseNote and the flight recorder's dumps carry it.
"""
import os


def user_line(traceback: object) -> str:
    """Where the program's own code was when ``traceback``'s exception left it, else ""."""
    frame = None
    roots = _library_roots()
    while traceback is not None:
        filename = traceback.tb_frame.f_code.co_filename  # type: ignore[attr-defined]
        if not _library_file(filename, roots):
            frame = traceback
        traceback = traceback.tb_next  # type: ignore[attr-defined]
    if frame is None:
        return ""
    code = frame.tb_frame.f_code
    return f"{_shown_path(code.co_filename)}:{frame.tb_lineno} in {code.co_name}"


def frame_line(frame: object) -> str:
    """``user_line`` for a live stack: the innermost frame of the program's own code from
    ``frame`` outwards (``sys._current_frames()``), as ``file:line in function``, else ""."""
    roots = _library_roots()
    while frame is not None:
        code = frame.f_code  # type: ignore[attr-defined]
        if not _library_file(code.co_filename, roots):
            return f"{_shown_path(code.co_filename)}:{frame.f_lineno} in {code.co_name}"  # type: ignore[attr-defined]
        frame = frame.f_back  # type: ignore[attr-defined]
    return ""


def _shown_path(path: str) -> str:
    """``path`` relative to the current folder when under it."""
    try:
        here = os.getcwd()
    except OSError:  # the current folder was removed
        here = os.sep
    if not path.startswith("<") and here != os.sep:
        relative = os.path.relpath(path, here)
        path = relative if not relative.startswith(os.pardir) else path
    return path


def _library_file(filename: str, roots: "list[str]") -> bool:
    if filename.startswith("<"):
        return filename.startswith("<frozen ")  # <string> (python -c) and <stdin> are the user's
    path = os.path.realpath(filename)
    if f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path:
        return True
    return any(path == root or path.startswith(root + os.sep) for root in roots)


def _library_roots() -> "list[str]":
    import sys
    import sysconfig
    roots = [sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")]
    roots.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # mtrain.launcher
    for name in ("mtrain", "mtrain.ringreduce"):  # mtrain (its bindings, mtrain.torch, ...) and the runtime
        roots.extend(getattr(sys.modules.get(name), "__path__", None) or ())
    return [os.path.realpath(root) for root in roots if root]
