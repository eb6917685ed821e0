"""Runs Python scripts, each in a process of its own forked from one interpreter that imported torch.

Started once per test module as ``python script_runner.py`` (a plain interpreter, not the pytest
process), through :func:`start_runner`: it imports torch, which every guide and example script
imports first (directly or through d9d), then reads one request per line on stdin (JSON: script or
module, args, stdout, stderr, and ``preload``: modules the script imports at its top, imported here
once for every later request). For each request it forks a child that runs the script as ``python
SCRIPT ARGS`` run from the request's working directory would: as ``__main__``, with ``sys.argv`` set,
the script's directory first on ``sys.path`` and the interpreter's normal exit (atexit handlers
run); a module request runs as ``python -m MODULE ARGS`` would (the working directory first on
``sys.path``). It answers with the child's exit status. The child starts with the modules a fresh
interpreter holds once the script's own import lines ran; only the seconds of those imports are
saved per run.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import torch  # noqa: F401  # pyright: ignore[reportUnusedImport]  (see the module docstring)

RUNNER = Path(__file__).resolve()


def _child(request: dict[str, Any]) -> int:
    os.chdir(request["cwd"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
    os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    try:
        if "module" in request:
            sys.argv = ["-m", *request["args"]]  # run_module sets argv[0] to the module's file
            sys.path[0] = request["cwd"]  # as for `python -m MODULE`
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            script: str = request["script"]
            sys.argv = [script, *request["args"]]
            sys.path[0] = os.path.dirname(script)  # as for `python SCRIPT` (this runner's directory is not)
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
        for name in request.get("preload", []):
            # A module that fails here fails again at the script's own import line, in the child,
            # with its traceback (the runner goes on serving the other scripts).
            with contextlib.suppress(Exception):
                importlib.import_module(name)
        pid = os.fork()
        if pid == 0:
            code = _child(request)
            sys.stdout.flush()
            sys.stderr.flush()
            raise SystemExit(code)  # the interpreter's own exit, atexit handlers included
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


# --- the test side --------------------------------------------------------------------------------


def start_runner(cwd: Path) -> subprocess.Popen[str]:
    """This runner in a plain interpreter; close its stdin (``stop_runner``) to end it."""
    # Without the d9d pytest plugin's zygote variable, run_distributed forks ranks from the script.
    env = {k: v for k, v in os.environ.items() if k != "D9D_TESTING_ZYGOTE"}
    return subprocess.Popen(
        [sys.executable, str(RUNNER)],
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a script that hangs: the whole process group is ended
    )


def stop_runner(runner: subprocess.Popen[str]) -> None:
    assert runner.stdin is not None
    runner.stdin.close()
    runner.wait(timeout=60)


def run_script(
    runner: subprocess.Popen[str],
    script: Path,
    *args: str,
    cwd: Path,
    timeout_s: float,
    preload: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """``python script *args`` run from ``cwd`` in a child of ``runner``: its status, stdout and stderr."""
    request = {"script": str(script), "args": list(args), "preload": list(preload)}
    return _run(runner, request, script.stem, str(script), cwd=cwd, timeout_s=timeout_s)


def run_module(
    runner: subprocess.Popen[str],
    module: str,
    *args: str,
    cwd: Path,
    timeout_s: float,
    preload: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """``python -m module *args`` run from ``cwd`` in a child of ``runner``: its status, stdout and stderr."""
    request = {"module": module, "args": list(args), "preload": list(preload)}
    return _run(runner, request, module, module, cwd=cwd, timeout_s=timeout_s)


def _run(
    runner: subprocess.Popen[str],
    request: dict[str, Any],
    stem: str,
    what: str,
    *,
    cwd: Path,
    timeout_s: float,
) -> subprocess.CompletedProcess[str]:
    """Sends ``request`` (its script or module, args and preload) and waits for the child's status."""
    assert runner.stdin is not None and runner.stdout is not None
    stdout, stderr = cwd / f"{stem}.stdout", cwd / f"{stem}.stderr"
    request = {**request, "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr)}
    runner.stdin.write(json.dumps(request) + "\n")
    runner.stdin.flush()
    ready, _, _ = select.select([runner.stdout], [], [], timeout_s)
    if not ready:
        os.killpg(runner.pid, signal.SIGKILL)
        raise AssertionError(f"{what} did not finish within {timeout_s:.0f} s")
    line = runner.stdout.readline()
    assert line, f"the script runner ended (status {runner.poll()})"
    return subprocess.CompletedProcess(
        [what, *request["args"]], json.loads(line)["returncode"], stdout.read_text(), stderr.read_text()
    )


if __name__ == "__main__":
    main()
