"""A clean process to fork test ranks from, for test processes that already ran autograd.

PyTorch refuses autograd in a process forked from a parent that has run a backward pass
("Unable to handle autograd's threading in combination with fork-based multiprocessing"). A test
session usually computes single-process references in the parent, so forking ranks from it
would break every later multi-rank test. The zygote is forked from the test process once, after
test collection and before any test runs; ``run_distributed`` then asks it, over a Unix socket,
to fork a coordinator that forks the ranks. The zygote never runs torch code itself.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import socket
import struct
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

ZYGOTE_ENV = "D9D_TESTING_ZYGOTE"
"""Environment variable holding the zygote's socket path while it runs."""

_HEADER = struct.Struct("!Q")


def send_message(conn: socket.socket, payload: bytes) -> None:
    """Sends one length-prefixed message."""
    conn.sendall(_HEADER.pack(len(payload)) + payload)


def receive_message(conn: socket.socket) -> bytes:
    """Receives one length-prefixed message."""
    header = _receive_exactly(conn, _HEADER.size)
    (length,) = _HEADER.unpack(header)
    return _receive_exactly(conn, length)


def _receive_exactly(conn: socket.socket, size: int) -> bytes:
    chunks: list[bytes] = []
    remaining = size
    while remaining:
        chunk = conn.recv(min(remaining, 1 << 20))
        if not chunk:
            raise ConnectionError("d9d test zygote closed the connection")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


Handler = Callable[[bytes], bytes]


def start_zygote(handler: Handler) -> tuple[int, str]:
    """Forks the zygote; each request it receives is answered by ``handler`` in a fresh fork.

    Returns:
        The zygote's pid and its socket path.
    """
    directory = tempfile.mkdtemp(prefix="d9d-zygote-")
    path = os.path.join(directory, "socket")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    pid = os.fork()
    if pid == 0:
        try:
            _serve(server, handler)
        finally:
            os._exit(0)
    server.close()
    return pid, path


def _serve(server: socket.socket, handler: Handler) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # coordinators are reaped automatically
    while True:
        conn, _ = server.accept()
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the coordinator waits for its ranks
            try:
                request = receive_message(conn)
                try:
                    reply = handler(request)
                except BaseException:
                    reply = pickle.dumps(("crashed", traceback.format_exc()))
                send_message(conn, reply)
            finally:
                os._exit(0)
        conn.close()


def stop_zygote(pid: int, path: str) -> None:
    """Ends the zygote and removes its socket."""
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def ask_zygote(path: str, request: bytes, timeout_s: float) -> Any:
    """Sends a request to the zygote at ``path`` and returns the unpickled reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        conn.connect(path)
        send_message(conn, request)
        return pickle.loads(receive_message(conn))
