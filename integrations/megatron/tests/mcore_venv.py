"""A cached virtual environment with another megatron-core version, for tests that run it.

``--system-site-packages``, so torch 2.13.0 and tenplex's CPU shim are shared; megatron-core is
installed with ``pip install --no-deps --ignore-requires-python`` (and whatever else the version
imports without declaring it), as docs/megatron.md says. Cached in the temp directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

EXTRA = {"0.19.2": ("triton==3.7.1",)}  # 0.19.2 imports triton without declaring it


def venv_python(version: str) -> str:
    """The python of a cached venv with megatron-core ``version``; skips the test if pip cannot install it."""
    root = os.path.join(tempfile.gettempdir(), f"tenplex-mcore-{version}-venv")
    python = os.path.join(root, "bin", "python")
    check = [python, "-c", f"import megatron.core as m; assert m.__version__ == '{version}'"]
    if os.path.exists(python) and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    steps = [[sys.executable, "-m", "venv", "--system-site-packages", root],
             [python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-requires-python",
              f"megatron-core=={version}"]]
    steps += [[python, "-m", "pip", "install", "-q", "--no-deps", spec] for spec in EXTRA.get(version, ())]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.skip(f"cannot install megatron-core {version} ({' '.join(cmd[2:])}): "
                        f"{(done.stderr or done.stdout).strip()[-300:]}")
    done = subprocess.run(check, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return python


_NAMED = """import json, pickle, sys
seen = set()
class Recorder(pickle.Unpickler):
    def find_class(self, module, name):
        seen.add((module, name))
        return super().find_class(module, name)
Recorder(open(sys.argv[1], "rb")).load()
print(json.dumps(sorted(seen)))
"""


def globals_named(python: str, path) -> set[tuple[str, str]]:
    """The globals the pickle at ``path`` names, unpickled by ``python`` (a file a test's own
    megatron-core run just wrote, whose classes only that version has)."""
    done = subprocess.run([python, "-c", _NAMED, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return {tuple(g) for g in json.loads(done.stdout)}
