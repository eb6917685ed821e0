"""Runs guide scripts, each in a process of its own forked from one that imported torch.

Started once by test_guides.py as ``python guide_runner.py`` (a plain interpreter, not the
pytest process): it imports torch, the first thing every guide's script imports directly or
through d9d, and then reads one request per line on stdin (JSON: script, stdout, stderr). For
each it forks a child that runs the script as ``python SCRIPT`` would, from the script's
directory, as ``__main__``, with the script's directory first on ``sys.path`` and the normal
interpreter exit (atexit handlers run), and it answers with the child's exit status. The child
starts with exactly the modules a fresh interpreter holds after ``import torch``; only the
seconds of that import are saved per guide.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback

import torch  # noqa: F401  (see the module docstring)


def _child(script: str, stdout: str, stderr: str) -> int:
    directory = os.path.dirname(script)
    os.chdir(directory)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
    os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    sys.argv = [script]
    sys.path[0] = directory  # as for `python SCRIPT` (this runner's own directory is not there)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = _child(request["script"], request["stdout"], request["stderr"])
            sys.stdout.flush()
            sys.stderr.flush()
            raise SystemExit(code)  # the interpreter's own exit, atexit handlers included
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
