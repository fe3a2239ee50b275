"""In a process the zygote forked for an xdist worker: become what `python -u -c CODE` would have
been, so that execnet's bootstrap runs there as in a fresh interpreter."""

from __future__ import annotations

import os
import signal
import sys
import traceback
import types


def run_as_python(cwd: str, environ: dict[str, str], code: str) -> int:
    """Make this forked process what `python -u -c code` started in `cwd` with `environ` would
    be (its own __main__, argv, path, streams on fds 0-2, Python's signal handling), run `code`
    and the exit handlers as the interpreter's exit would; the exit code."""
    import atexit

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    for signum in (signal.SIGPIPE, signal.SIGXFSZ):  # as Python's start-up leaves them
        signal.signal(signum, signal.SIG_IGN)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    sys.argv = ["-c"]
    sys.path[0] = ""
    _forget_pytest_plugins()
    main = sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)
        exit_code = 0
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            exit_code = done.code or 0
        else:  # sys.exit("message"): the interpreter prints it and exits with 1
            print(done.code, file=sys.stderr)
            exit_code = 1
    except BaseException:
        traceback.print_exc()
        exit_code = 1
    atexit._run_exitfuncs()
    return exit_code


def _forget_pytest_plugins() -> None:
    """pytest rewrites the asserts of the plugins it loads (pytest11 entry points, this one
    too), and warns of each that was imported before: the worker imports them again itself."""
    from importlib import metadata

    plugins = {entry.module.partition(".")[0] for entry in metadata.entry_points(group="pytest11")}
    for name in [name for name in sys.modules if name.partition(".")[0] in plugins]:
        del sys.modules[name]
