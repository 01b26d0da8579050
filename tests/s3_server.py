"""A real S3 API server on 127.0.0.1 for the object-store tests: moto's server mode, one process.

:class:`S3Server` binds a listening socket on port 0 of 127.0.0.1 and keeps it, starts moto's
server in a subprocess that serves on that very socket (inherited, so no other process can take
the port between the choice and the start, as a released "free" port could be under pytest-xdist),
waits until it answers, and stops it at the end; :meth:`S3Server.env` is the environment that
points botocore (hence s3fs, hence cadence) at it: ``AWS_ENDPOINT_URL`` and fake credentials.
:meth:`S3Server.bucket` makes a fresh bucket. ``s3_server`` is the session-scoped pytest fixture
(tests/conftest.py provides it); the benchmarks use the class directly.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
import urllib.request

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "cadence-test",
    "AWS_SECRET_ACCESS_KEY": "cadence-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_buckets = itertools.count()


_SERVE = """
import os, sys
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from moto.server import MotoRequestHandler
from werkzeug.serving import make_server
fd, port = int(sys.argv[1]), sys.argv[2]
os.environ["MOTO_PORT"] = port
import threading
dispatcher = DomainDispatcherApplication(create_backend_app)
conditional = threading.Lock()
def app(environ, start_response):
    # moto checks a write's If-None-Match / If-Match and then writes, in two steps: of racing
    # conditional writes of one key, several could pass the check. S3 decides them atomically, so
    # conditional writes are served one at a time here (the rest stays threaded).
    if "HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MATCH" in environ:
        with conditional:
            return list(dispatcher(environ, start_response))
    return dispatcher(environ, start_response)
make_server("127.0.0.1", int(port), app, threaded=True, request_handler=MotoRequestHandler, fd=fd).serve_forever()
"""


class S3Server:
    """moto's S3 server on a port of 127.0.0.1 that this object holds bound from its creation to
    :meth:`stop`; started by :meth:`start`."""

    def __init__(self) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(64)
        self.port = int(self.socket.getsockname()[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        """What a process needs to use this server as its S3: the endpoint and fake credentials
        (no instance metadata, config or credential files are consulted)."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint, "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def start(self, timeout: float = 60.0) -> S3Server:
        fd = self.socket.fileno()
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(fd), str(self.port)], pass_fds=(fd,),
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
        self.socket.close()

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
