"""The hostile corpus through the Python APIs, and the allow-lists against real files.

Each case of :mod:`hostile_corpus` must raise its tenplex error from the
lowest API that reads the file (``read_metadata``, ``SafeReader``,
``safe_load`` with and without ``mmap``, ``read_objects``) and from the
format's whole read (the plugin's ``open_source``, then every tensor and
value converted to a tenplex store; ``reshard_dist`` for byte objects), with
nothing run and nothing written. Real files written by megatron-core must load exactly as
Python's and torch's own unpicklers load them, and the allow-lists must hold
exactly the globals those files name.
"""

from __future__ import annotations

import argparse
import pickle
import pickletools
import shutil
import threading
import warnings

import pytest
import torch

from hostile_corpus import CASES, CWD_MARKER, DOPT_PT, MODEL, MODEL_PT, Ctx, real_checkpoint
from hostile_pickles import pt_records
from mcore_helpers import run_worker

from tenplex.formats import write_store
from tenplex.errors import TenplexError
from tenplex.ptree.config import ParallelConfig
from tenplex_megatron.dcp import safe as dcp_safe
from tenplex_megatron.torchfiles import safe_load as safe_load_module
from tenplex_megatron.dcp.load import SafeReader, to_torch
from tenplex_megatron.dcp.safe import read_metadata, read_objects
from tenplex_megatron.formats.dist.direct import reshard_dist
from tenplex_megatron.formats.plugin import DIST, LEGACY
from tenplex_megatron.torchfiles.safe_load import safe_load


def _read_all(fmt: str, path: str, out: str) -> None:
    """The format's whole read: open the source (metadata, args, objects), then read every
    tensor and value into a tenplex store at ``out``."""
    source = (DIST if fmt == "dist" else LEGACY).open_source(path)
    write_store(source, out, source.config)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    return real_checkpoint(tmp_path_factory.mktemp("hostile-real"))


def _refuses(case, call) -> None:
    with pytest.raises(case.error, match=case.message) as info:
        call()
    assert isinstance(info.value, TenplexError)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_api_refuses_hostile_file(case, real, tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(real / case.fmt, ckpt, symlinks=True)
    ctx = Ctx(marker=tmp_path / "MARKER")
    case.make(ckpt, ctx)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    if case.api == "metadata":
        _refuses(case, lambda: read_metadata(str(ckpt)))
        _refuses(case, lambda: SafeReader(str(ckpt)).read_metadata())
    elif case.api == "pt":
        _refuses(case, lambda: safe_load(ckpt / case.file))
        _refuses(case, lambda: safe_load(str(ckpt / case.file), mmap=True))
    else:
        _refuses(case, lambda: read_objects(str(ckpt), read_metadata(str(ckpt))))
    if case.api == "objects":  # a direct reshard reads every byte object
        _refuses(case, lambda: reshard_dist(str(ckpt), str(tmp_path / "out"), ParallelConfig()))
    else:
        _refuses(case, lambda: _read_all(case.fmt, str(ckpt), str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()
    assert not ctx.marker.exists() and not list(tmp_path.rglob(CWD_MARKER)), "a payload ran"


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, argparse.Namespace):
        return type(b) is argparse.Namespace and _same(vars(a), vars(b))
    if hasattr(a, "dtype") and hasattr(a, "tobytes"):  # numpy arrays
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("rel", ["dist/common.pt", f"legacy/{MODEL_PT}", f"legacy/{DOPT_PT}"])
@pytest.mark.parametrize("mmap", [False, True])
def test_real_pt_files_load_as_torch_loads_them(real, rel, mmap):
    ours = safe_load(str(real / rel), mmap=mmap)
    theirs = torch.load(real / rel, weights_only=False)  # written by megatron-core in this test
    assert _same(ours, theirs)


def test_real_dcp_directory_loads_as_dcp_loads_it(real):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    root = str(real / "dist")
    md = read_metadata(root)
    with open(real / "dist" / ".metadata", "rb") as f:
        theirs = pickle.load(f)  # written by megatron-core in this test
    torch_md = to_torch(md)  # tenplex's records, as torch's classes: equal field by field
    assert torch_md.state_dict_metadata == theirs.state_dict_metadata
    assert torch_md.storage_data == theirs.storage_data and torch_md.planner_data == theirs.planner_data
    assert type(SafeReader(root).read_metadata()) is type(theirs)
    ours = {k: torch.full(tuple(v.size), 7.0, dtype=v.properties.dtype)
            for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    ref = {k: torch.zeros_like(v) for k, v in ours.items()}
    SafeReader(root).load(ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.load(ref, storage_reader=dcp.FileSystemReader(root), no_dist=True)
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ours)
    objects = read_objects(root, md)
    assert objects and all(o == [None] for o in objects.values())


def _globals_named(data: bytes) -> set:
    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)


    Recorder(__import__("io").BytesIO(data)).load()  # files written by megatron-core in this test
    return seen


OLDER = {("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"),
         ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata")}
"""Named by megatron-core 0.13 to 0.15's files only (formats/test_megatron_core_013.py checks them there)."""


def test_dcp_allow_list_is_exactly_what_real_metadata_names(real):
    named = _globals_named((real / "dist" / ".metadata").read_bytes())
    allowed = set(dcp_safe.DCP_GLOBALS)
    dtypes = {("torch", n) for n in safe_load_module.TORCH_DTYPES}
    assert named <= allowed
    assert allowed - dtypes - OLDER == named - dtypes, "an allowed DCP global that real files do not name"


@pytest.fixture(scope="module")
def real_bf16_adam(tmp_path_factory):
    """A legacy file of bf16 params with a non-distributed Adam, by megatron-core: its fp32 main
    params carry attributes, so torch.save pickles them by ``_rebuild_from_type_v2``."""
    d = tmp_path_factory.mktemp("hostile-bf16")
    flags = MODEL.replace(" --dist-opt --sharding-type fully_reshardable", "") + " --bf16"
    run_worker(1, 1, flags, "--save", "legacy", "--save-dir", str(d))
    return d / MODEL_PT


@pytest.mark.parametrize("mmap", [False, True])
def test_real_bf16_adam_file_loads_as_torch_loads_it(real_bf16_adam, mmap):
    """Refused before (``torch._tensor._rebuild_from_type_v2`` was not allowed): tenplex could not
    read megatron-core's legacy checkpoints of bf16 models trained without the distributed optimizer."""
    ours = safe_load(str(real_bf16_adam), mmap=mmap)
    theirs = torch.load(real_bf16_adam, weights_only=False)  # written by megatron-core in this test
    assert _same(ours, theirs)
    mains = [m for group in ours["optimizer"]["fp32_from_fp16_params"] for m in group]
    assert mains and all(m.dtype == torch.float32 for m in mains)


def test_pt_allow_list_is_exactly_what_real_files_name(real, real_bf16_adam):
    named = set()
    for path in [real / "dist/common.pt", real / "legacy" / MODEL_PT, real / "legacy" / DOPT_PT, real_bf16_adam]:
        data = pt_records(path.read_bytes())["data.pkl"]  # protocol 2: GLOBAL only
        named |= {tuple(arg.split(" ", 1)) for op, arg, _ in pickletools.genops(data)
                  if op.name == "GLOBAL"}
    allowed = set(safe_load_module.TORCH_GLOBALS)
    values = {k for k, r in safe_load_module.TORCH_GLOBALS.items()
              if k[0] == "torch" and r.reduce is None and r.new is None}  # dtypes and storage types
    assert named <= allowed
    # numpy 1.x wrote the same _reconstruct under numpy.core.multiarray
    assert allowed - values - named == {("numpy.core.multiarray", "_reconstruct")}
    assert all(r.reason for r in safe_load_module.TORCH_GLOBALS.values())


def test_allowed_names_are_not_remapped_by_torch():
    """torch's unpickler maps Python 2 names (``_compat_pickle``); none of ours may be remapped,
    or torch would load a different global than the one tenplex checked."""
    import _compat_pickle
    for module, name in safe_load_module.TORCH_GLOBALS:
        assert module not in _compat_pickle.IMPORT_MAPPING
        assert (module, name) not in _compat_pickle.NAME_MAPPING
        assert "." not in name


def test_torch_allow_list_is_restored_after_loads_in_threads(real):
    before = set(map(repr, torch.serialization.get_safe_globals()))
    errors = []

    def load():
        try:
            for _ in range(5):
                assert safe_load(real / "legacy" / MODEL_PT)["args"].num_layers == 2
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert set(map(repr, torch.serialization.get_safe_globals())) == before
