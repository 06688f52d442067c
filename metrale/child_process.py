"""Fresh Python processes that serve their parent over a socket: the engine process
(:mod:`metrale.entrypoints.engine_process`) and the structured-output sandbox (:mod:`metrale.structured.sandbox`)."""

from __future__ import annotations

import socket
import subprocess
import sys
from multiprocessing.connection import Connection


def start_child(module: str, function: str) -> tuple[subprocess.Popen, Connection]:
    """Start ``python -c "from MODULE import FUNCTION; FUNCTION(fd)"`` on one end of a socket
    pair, with this process's import path; returns the process and the other end. A fresh
    interpreter imports only what it needs (not the caller's ``__main__``, as a
    ``multiprocessing`` start would), and it sees its parent go away as the end of its
    connection."""
    parent_socket, child_socket = socket.socketpair()
    bootstrap = (f"import sys; sys.path[:] = {sys.path!r}; "
                 f"from {module} import {function}; {function}({child_socket.fileno()})")
    try:
        process = subprocess.Popen([sys.executable, "-c", bootstrap], pass_fds=[child_socket.fileno()],
                                   stdin=subprocess.DEVNULL)
    finally:
        child_socket.close()
    return process, Connection(parent_socket.detach())
