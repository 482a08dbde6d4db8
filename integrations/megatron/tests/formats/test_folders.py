"""Where a Megatron checkpoint lies (formats/folders.py): the --save root, its tracker and iteration folders."""

import re

import pytest

from tenplex.errors import ConfigError, ManifestError
from tenplex_megatron.formats.folders import TRACKER, locate, write_tracker
from tenplex_megatron.formats.plugin import _iteration


def _root(tmp_path, *iterations, tracker=None):
    tmp_path.mkdir(exist_ok=True)
    for it in iterations:
        (tmp_path / ("release" if it == "release" else f"iter_{it:07d}")).mkdir()
    if tracker is not None:
        write_tracker(str(tmp_path), tracker)
    return str(tmp_path)


def test_the_tracker_names_the_folder_and_iteration_picks_another(tmp_path):
    root = _root(tmp_path, 5, 10, tracker=10)
    assert locate(root) == (f"{root}/iter_0000010", 10, root)
    assert locate(root, 5) == (f"{root}/iter_0000005", 5, root)
    assert locate(f"{root}/iter_0000005") == (f"{root}/iter_0000005", 5, None)
    with pytest.raises(ManifestError, match=r"iter_0000007: the iteration folder asked for is missing "
                                            r"\(iteration folders present: \[5, 10\]\)"):
        locate(root, 7)
    with pytest.raises(ManifestError, match="an iteration folder of iteration 5; --iteration 10"):
        locate(f"{root}/iter_0000005", 10)
    assert (tmp_path / TRACKER).read_text() == "10"


def test_release_a_missing_tracker_folder_and_a_root_without_tracker(tmp_path):
    (tmp_path / "a").mkdir()
    assert locate(_root(tmp_path / "a", "release", tracker="release")).iteration == "release"
    (tmp_path / "b").mkdir()
    with pytest.raises(ManifestError, match="named by latest_checkpointed_iteration.txt is missing"):
        locate(_root(tmp_path / "b", 5, tracker=6))
    (tmp_path / "c").mkdir()
    root = _root(tmp_path / "c", 5, 6)
    with pytest.raises(ManifestError, match=r"no latest_checkpointed_iteration.txt, and iteration folders "
                                            r"\[5, 6\]; pick one with --iteration N"):
        locate(root)
    assert locate(root, 6).iteration == 6
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / TRACKER).write_text("five")
    with pytest.raises(ManifestError, match="expected an iteration number or 'release', found 'five'"):
        locate(str(tmp_path / "d"))
    bare = tmp_path / "bare"
    bare.mkdir()
    assert locate(str(bare)) == (str(bare), None, None)


def test_the_iteration_option():
    assert _iteration({}) is None and _iteration({"iteration": "12"}) == 12
    assert _iteration({"iteration": "release"}) == "release" and _iteration({"iteration": 3}) == 3
    with pytest.raises(ConfigError, match="--iteration -1"):
        _iteration({"iteration": -1})


@pytest.mark.parametrize("tracker,folders,expected", [
    ("11", [10], r"iter_0000011: the iteration folder named by latest_checkpointed_iteration.txt is missing "
                 r"\(iteration folders present: \[10\]\)"),
    ("", [10], r"latest_checkpointed_iteration.txt: expected an iteration number or 'release', found ''"),
    ("10", [10], r"iter_0000010: not a Megatron checkpoint folder: expected mp_rank_\* directories "
                 r"\(--ckpt-format torch\) or a metadata.json saying torch_dist .*, found 'notes.txt'"),
])
def test_the_cli_names_what_is_wrong_with_a_save_root(tmp_path, tracker, folders, expected):
    """A --save root whose tracker names no readable folder is not 'not a checkpoint of any known format':
    every command names the fault (on the old code, each case was "not a checkpoint")."""
    import re

    from inprocess_cli import tenplex

    root = _root(tmp_path / "save", *folders)
    (tmp_path / "save" / TRACKER).write_text(tracker)
    (tmp_path / "save" / "iter_0000010" / "notes.txt").write_text("not a checkpoint")
    for args in (["inspect", root], ["plan", root, "--to", "tp=1"], ["reshard", root, str(tmp_path / "out"),
                                                                     "--to", "tp=1"]):
        done = tenplex(*args)
        assert done.returncode == 1 and re.search(expected, done.stderr), (args, done.stderr)
        assert not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process
def test_a_dcp_folder_without_megatron_metadata_is_named(tmp_path):
    """Megatron-LM's ``--ckpt-format torch_dcp`` and ``fsdp_dtensor`` save plain PyTorch DCP folders (no
    megatron-core ``metadata.json``). Every command says so, for the ``--save`` root and for the
    iteration folder itself; a ``metadata.json`` of another backend is named too. (On the old code
    the root's message said nothing of DCP, and the folder was "not a checkpoint of any known format".)"""
    import torch
    import torch.distributed.checkpoint as dcp

    from inprocess_cli import tenplex

    root = _root(tmp_path / "save", 10, tracker=10)
    folder = tmp_path / "save" / "iter_0000010"
    dcp.save({"model": {"decoder.final_layernorm.weight": torch.ones(4)}},
             storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    said = "a PyTorch DCP checkpoint without megatron-core's metadata.json .*torch_dcp or fsdp_dtensor"
    for path in (root, str(folder)):
        for args in (["inspect", path], ["reshard", path, str(tmp_path / "out"), "--to", "tp=1"]):
            done = tenplex(*args)
            assert done.returncode == 1 and re.search(said, done.stderr), (args, done.stderr)
            assert not (tmp_path / "out").exists()
    zarr = tmp_path / "zarr"
    zarr.mkdir()
    (zarr / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    done = tenplex("inspect", str(zarr))
    assert done.returncode == 1 and "names the sharded backend 'zarr': tenplex reads torch_dist" in done.stderr
