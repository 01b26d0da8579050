"""A real S3 API server on 127.0.0.1 for the object-store tests: moto's server mode, one process.

:class:`S3Server` starts ``python -m moto.server -H 127.0.0.1 -p <free port>`` as a subprocess,
waits until it answers, and stops it at the end; :meth:`S3Server.env` is the environment that
points botocore (hence s3fs, hence cadence) at it: ``AWS_ENDPOINT_URL`` and fake credentials.
:meth:`S3Server.bucket` makes a fresh bucket. ``s3_server`` is the session-scoped pytest fixture
(import it into a test module); the benchmarks use the class directly.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Iterator

import pytest

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "cadence-test",
    "AWS_SECRET_ACCESS_KEY": "cadence-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_buckets = itertools.count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """moto's S3 server on a free port of 127.0.0.1, started by :meth:`start`, stopped by :meth:`stop`."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        """What a process needs to use this server as its S3: the endpoint and fake credentials
        (no instance metadata, config or credential files are consulted)."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint, "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def start(self, timeout: float = 60.0) -> S3Server:
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with status {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server did not answer on {self.endpoint} within {timeout:g}s") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def bucket(self) -> str:
        """A new, empty bucket's name."""
        import s3fs

        name = f"cadence-{os.getpid()}-{next(_buckets)}"
        fs = s3fs.S3FileSystem(key=CREDENTIALS["AWS_ACCESS_KEY_ID"], secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                               endpoint_url=self.endpoint, skip_instance_cache=True)
        fs.mkdir(name)
        return name

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A running :class:`S3Server`; this process's environment points at it for the session (so
    in-process s3fs use and the cadence subprocesses, which inherit it, reach the same server)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    saved = {k: os.environ.get(k) for k in S3Server().env()}
    with S3Server() as server:
        os.environ.update(server.env())
        try:
            yield server
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
