"""Hypothesis profiles, and the moto S3 server that s3:// tests share."""

import os
import socket
import subprocess
import sys
import time

import fsspec
import pytest
from hypothesis import HealthCheck, settings

from tests.helpers.rendezvous import free_port


settings.register_profile(
    "default", deadline=None, max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=400)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


ENDPOINT_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1, started and stopped by the tests (one per session).

    Its credentials and endpoint are set in ``os.environ`` (inherited by CLI subprocesses and
    spawned workers) and in fsspec's config while it runs; a test makes its own bucket.
    """
    port = free_port()
    env = dict(os.environ, **ENDPOINT_ENV)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
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
    yield endpoint
    fsspec.config.conf.get("s3", {}).pop("endpoint_url", None)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_bucket(s3_endpoint):
    """``s3://tenplex-test`` on the moto server; each test writes under a fresh prefix."""
    fsspec.filesystem("s3", endpoint_url=s3_endpoint, skip_instance_cache=True).mkdir("tenplex-test")
    return "s3://tenplex-test"
