"""The moto S3 server the conformance suite's s3:// backend runs on (127.0.0.1, started by the tests)."""

import os
import socket
import subprocess
import sys
import time

import fsspec
import pytest

from tests.helpers.rendezvous import free_port


ENDPOINT_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1, started and stopped by the tests."""
    port = free_port()
    env = dict(os.environ, **ENDPOINT_ENV)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("moto server did not start")
            time.sleep(0.2)
    saved = {k: os.environ.get(k) for k in list(ENDPOINT_ENV) + ["FSSPEC_S3_ENDPOINT_URL"]}
    os.environ.update(ENDPOINT_ENV)
    os.environ["FSSPEC_S3_ENDPOINT_URL"] = endpoint  # for CLI subprocesses
    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = endpoint
    fs = fsspec.filesystem("s3", endpoint_url=endpoint, skip_instance_cache=True)
    fs.mkdir("tenplex-test")
    yield endpoint
    fsspec.config.conf.get("s3", {}).pop("endpoint_url", None)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.terminate()
    proc.wait(timeout=10)
