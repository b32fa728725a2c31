"""A server in a subprocess on 127.0.0.1: started on a free port, waited for, always stopped (chapter 13).

The chapter, the tests and the serving benchmark all run servers this way:
``with ServerProcess.minivllm("--model", "tiny-random") as server: ...``.
Waiting for ``/health`` is bounded in time, and the server is stopped by its
own process id (SIGTERM, then SIGKILL if it does not exit in time).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

__all__ = ["free_port", "ServerProcess"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``argv`` run as a subprocess serving HTTP at ``http://127.0.0.1:port``, its output in a log file."""

    def __init__(self, argv: list[str], port: int, env: dict | None = None, health: str = "/health",
                 base_env: dict | None = None):
        self.argv, self.port, self.health = list(argv), port, health
        self.extra_env = dict(env or {})  # what this server gets beyond the caller's environment (or ``base_env``)
        base = os.environ if base_env is None else base_env
        self.env = {**base, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **self.extra_env}
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="server-", suffix=".log", delete=False)
        self._final_log: str | None = None

    @classmethod
    def minivllm(cls, *flags: str, port: int | None = None, env: dict | None = None) -> ServerProcess:
        """``python -m minivllm serve FLAGS`` on 127.0.0.1 and a free port."""
        port = port or free_port()
        return cls([sys.executable, "-m", "minivllm", "serve", "--host", "127.0.0.1", "--port", str(port), *flags],
                   port, env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, timeout: float = 300.0) -> ServerProcess:
        """Start the process and wait (at most ``timeout`` seconds) until ``/health`` answers 200."""
        return self.launch().wait_ready(timeout)

    def launch(self) -> ServerProcess:
        """Start the process and return at once (it loads its model meanwhile); :meth:`wait_ready` waits for it."""
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     stdin=subprocess.DEVNULL)
        atexit.register(self.stop)  # stopped even if the caller never gets to it (a notebook cell that failed)
        return self

    def wait_ready(self, timeout: float = 300.0) -> ServerProcess:
        """Wait at most ``timeout`` seconds until ``/health`` answers 200; a server that exits or never gets
        there raises (and is stopped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}:\n{self.log()[-3000:]}")
            if self._healthy():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout:.0f} s:\n{self.log()[-3000:]}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.health, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM to this process id, wait at most ``timeout`` seconds, then SIGKILL; returns the exit code."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc is not None and self.returncode is None:
            self.returncode = self.proc.returncode
            self._final_log = self.log()
            self._log.close()
            os.unlink(self._log.name)
            atexit.unregister(self.stop)
        return self.returncode

    def log(self) -> str:
        """Everything the server printed so far (kept after it stopped)."""
        if self._final_log is not None:
            return self._final_log
        self._log.flush()
        with open(self._log.name) as f:
            return f.read()

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
