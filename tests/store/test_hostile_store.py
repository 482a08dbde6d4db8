"""The hostile store corpus (``hostile_cases.py``) through the API and the CLI.

Every lie is refused before any of the file's bytes are used: the API raises
the case's error naming the file and the field; ``tenplex verify``,
``inspect`` (lies in the manifest) and ``reshard`` exit 1 with that one
line on stderr, no traceback, and nothing written at the destination.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

import tenplex.store.manifest_parse as manifest_parse
from tenplex.api import load, load_global, reshard, save, verify
from tenplex.cli.main import main
from tenplex.errors import ManifestError
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import ParallelConfig as P, materialize
from tenplex.store import StoreReader

from .hostile_cases import CASES

SPEC = GPTSpec(num_layers=2, hidden=32, heads=4, query_groups=2, ffn=64, vocab=100,
               dtype="bfloat16", optimizer="distributed_adam", bucket_numel=3000)
A = P(dp=2, tp=2)
IDS = [c[0] for c in CASES]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A valid local store (256-byte blocks) that each case copies."""
    root = tmp_path_factory.mktemp("hostile") / "pristine"
    tree = gpt_tree(SPEC)
    state = random_state(tree, A, 5)
    save(str(root), tree, A, {r: materialize(tree, state, A, r) for r in range(A.world_size)},
         block=256)
    return root


@pytest.fixture(params=CASES, ids=IDS)
def case(request, pristine, tmp_path):
    """``(store path, error class, pattern, level)`` of one hostile case."""
    name, edit, error, pattern, level = request.param
    root = tmp_path / name
    shutil.copytree(pristine, root)
    edit(root)
    return root, error, pattern, level


def test_pristine_store_passes(pristine, tmp_path):
    assert main(["verify", str(pristine)]) == 0
    assert main(["reshard", str(pristine), str(tmp_path / "out"), "--to", "dp=1,tp=1,pp=2"]) == 0


def test_api_refuses(case, tmp_path):
    root, error, pattern, level = case
    with pytest.raises(error, match=pattern):
        verify(str(root), progress=False)
    with pytest.raises(error, match=pattern):
        load(str(root), P(dp=1, tp=1, pp=1), 0)
    with pytest.raises(error, match=pattern):
        reshard(str(root), str(tmp_path / "out"), P(dp=1, tp=1, pp=2))
    assert not (tmp_path / "out").exists()
    if level == "manifest":
        with pytest.raises(error, match=pattern):
            StoreReader(str(root))
    else:
        with pytest.raises(error, match=pattern):
            load_global(str(root))


def _one_line(capsys, pattern: str) -> None:
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err[:2000]
    assert "Traceback" not in err
    assert re.search(pattern, err), err


def test_cli_refuses_with_one_line(case, tmp_path, capsys):
    root, error, pattern, level = case
    assert main(["verify", str(root)]) == 1
    _one_line(capsys, pattern)
    out = tmp_path / "out"
    assert main(["reshard", str(root), str(out), "--to", "dp=1,tp=1,pp=2"]) == 1
    _one_line(capsys, pattern)
    assert not out.exists()
    if level == "manifest":
        assert main(["inspect", str(root)]) == 1
        _one_line(capsys, pattern)


def test_oversized_manifest_is_refused(pristine, tmp_path, monkeypatch, capsys):
    size = (pristine / "manifest.json").stat().st_size
    monkeypatch.setattr(manifest_parse, "MAX_MANIFEST", size - 1)
    monkeypatch.setattr("tenplex.store.reader.MAX_MANIFEST", size - 1)
    pattern = rf"manifest\.json: expected at most {size - 1} bytes, found {size}"
    with pytest.raises(ManifestError, match=pattern):
        StoreReader(str(pristine))
    assert main(["verify", str(pristine)]) == 1
    _one_line(capsys, pattern)


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tenplex.cli.main", *args],
                          capture_output=True, text=True, timeout=300)


def _check_process(done: subprocess.CompletedProcess, pattern: str) -> None:
    assert done.returncode == 1, done.stderr[-2000:]
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert re.search(pattern, done.stderr), done.stderr


@pytest.mark.parametrize("name", ["digests-empty", "deep-json", "st-overlap"])
def test_console_refuses(name, pristine, tmp_path):
    """A few cases through ``python -m tenplex.cli.main``: verify, inspect and reshard."""
    _, edit, _, pattern, level = CASES[IDS.index(name)]
    root = tmp_path / name
    shutil.copytree(pristine, root)
    edit(root)
    _check_process(_cli("verify", str(root)), pattern)
    _check_process(_cli("reshard", str(root), str(tmp_path / "out"), "--to", "dp=1,tp=1,pp=2"),
                   pattern)
    assert not (tmp_path / "out").exists()
    if level == "manifest":
        _check_process(_cli("inspect", str(root)), pattern)


def test_reshard_of_corrupt_data_leaves_nothing_at_the_destination(pristine, tmp_path, capsys,
                                                                   monkeypatch):
    """A flipped byte deep in a tensor is found mid-reshard: the files written so far are removed."""
    import tenplex.store.writer as writer_module
    written, abort = [], writer_module.StoreWriter.abort

    def recording_abort(self):
        written.extend((tmp_path / "out" / "shards").iterdir())
        abort(self)

    monkeypatch.setattr(writer_module.StoreWriter, "abort", recording_abort)
    monkeypatch.setattr("tenplex.store.execute.READ_AHEAD", 1)  # a leaf a batch: the store is smaller than one
    root = tmp_path / "flipped"
    shutil.copytree(pristine, root)
    reader = StoreReader(str(root))
    last = max(reader.manifest.tensors.values(), key=lambda r: (r.file, r.offset))
    data = bytearray((root / last.file).read_bytes())
    data[last.offset + last.nbytes // 2] ^= 0xFF
    (root / last.file).write_bytes(bytes(data))
    out = tmp_path / "out"
    assert main(["reshard", str(root), str(out), "--to", "dp=1,tp=1,pp=2"]) == 1
    _one_line(capsys, rf"{last.file}: checksum mismatch in block \d+ .* holding .*{last.path}")
    assert written  # target files had been written when the corruption was found
    assert not out.exists()


def _in_thread(call, timeout: float = 60):
    """``call()``'s exception (or None) from a daemon thread; a hang fails the test, not the session."""
    import threading
    out: list = []

    def run():
        try:
            call()
            out.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"hung for {timeout} s"
    return out[0]


@pytest.mark.parametrize("name", ["manifest.json", "shard"])
def test_fifo_is_refused_without_blocking(name, pristine, tmp_path):
    """Issue 20: a ``manifest.json`` (or shard file) that is a FIFO hung ``tenplex`` and ``load`` forever."""
    import os
    from tenplex.errors import CorruptShardError
    root = tmp_path / "fifo"
    shutil.copytree(pristine, root)
    rel = name if name == "manifest.json" else StoreReader(str(root)).manifest.tensors[
        min(StoreReader(str(root)).manifest.tensors)].file
    os.unlink(root / rel)
    os.mkfifo(root / rel)
    exc = _in_thread(lambda: load_global(str(root)))
    assert isinstance(exc, CorruptShardError) and re.search(rf"{re.escape(rel)}: not a regular file", str(exc)), exc
    exc = _in_thread(lambda: main(["verify", str(root)]) == 1 or (_ for _ in ()).throw(AssertionError("exit 0")))
    assert exc is None, exc
