"""torch_dist checkpoints of bf16 models trained with a non-distributed Adam (Megatron-LM's default
``--ckpt-format`` without ``--use-distributed-optimizer``).

megatron-core's ``Float16OptimizerWithFloat16Params.sharded_state_dict`` saves the fp32 main params as
``optimizer.state.fp32_param.<key>`` tensors beside the moments, and ``common.pt``'s optimizer entry as
``{"optimizer": {"state": {"common_step"}, "param_groups"}}``. Before, tenplex refused every such
checkpoint (``unknown key optimizer.state.fp32_param...``). Training continuing after a reshard is
checked in ``test_training_continues.py``; here, the bytes and the refusals.
"""

from __future__ import annotations

import argparse
import pathlib

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader, load

from inprocess_cli import run_cli
from mcore_helpers import run_worker

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

FLAGS = ("--layers 2 --hidden 32 --heads 4 --ffn 64 --swiglu --position rope --untie --vocab 64 --seq 8 --batch 2 "
         "--train-steps 1 --bf16")


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("bf16-adam-dist")
    run_worker(1, 1, FLAGS, "--save", "dist", "--save-dir", str(d), "--dist-layout", "megatron")
    assert (d / "latest_checkpointed_iteration.txt").exists()  # Megatron-LM's --save root
    return d


def _read(path: pathlib.Path) -> tuple[dict, dict]:
    """Every DCP tensor (read by torch) and ``common.pt``'s optimizer entry of a folder or ``--save`` root."""
    folder = next(iter(sorted(path.glob("iter_*"))), path)
    md = FileSystemReader(str(folder)).read_metadata()
    tensors = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
               if hasattr(v, "size")}
    load(tensors, checkpoint_id=str(folder), no_dist=True)
    with torch.serialization.safe_globals([argparse.Namespace]):  # written by megatron-core or tenplex here
        common = torch.load(folder / "common.pt", weights_only=False)
    return tensors, common["optimizer"]


def _cli(tmp_path, *argv) -> str:
    done = run_cli(list(argv), cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_main_params_and_moments_survive_both_formats_bit_for_bit(src, tmp_path):
    """torch_dist -> legacy at tp 2, pp 2 -> torch_dist at tp 1 gives back every tensor of the source
    (fp32 main params, moments, bf16 params) and its optimizer entry; so does torch_dist -> torch_dist
    (items copied directly) there and back."""
    theirs, their_optim = _read(src)
    assert any(k.startswith("optimizer.state.fp32_param.") for k in theirs)
    assert set(their_optim) == {"optimizer"} and "common_step" in their_optim["optimizer"]["state"]
    _cli(tmp_path, "reshard", str(src), str(tmp_path / "l"), "--to", "tp=2,pp=2", "--format", "megatron-legacy")
    _cli(tmp_path, "reshard", str(tmp_path / "l"), str(tmp_path / "ld"), "--to", "tp=1,pp=1",
         "--format", "megatron-dist")
    _cli(tmp_path, "reshard", str(src), str(tmp_path / "d"), "--to", "tp=2,pp=2", "--format", "megatron-dist")
    _cli(tmp_path, "reshard", str(tmp_path / "d"), str(tmp_path / "dd"), "--to", "tp=1,pp=1",
         "--format", "megatron-dist")
    for back in ("ld", "dd"):
        ours, our_optim = _read(tmp_path / back)
        assert set(ours) == set(theirs), back
        for key, tensor in theirs.items():
            assert ours[key].dtype == tensor.dtype and torch.equal(ours[key], tensor), (back, key)
        assert our_optim == their_optim, back
    assert "OK (megatron-dist)" in _cli(tmp_path, "verify", str(tmp_path / "d"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_float32_hf_export_takes_the_main_params(src, tmp_path):
    """``--dtype float32`` exports the fp32 main params (``optimizer.state.fp32_param.*``), not the bf16
    params upcast: checked on the tensors the export copies as they are."""
    from safetensors import safe_open

    theirs, _ = _read(src)
    _cli(tmp_path, "reshard", str(src), str(tmp_path / "hf"), "--format", "hf", "--dtype", "float32")
    main = "optimizer.state.fp32_param."
    with safe_open(str(next((tmp_path / "hf").glob("*.safetensors"))), "pt") as f:
        pairs = [(f.get_tensor("model.norm.weight"), theirs[main + "decoder.final_layernorm.weight"])]
        pairs += [(f.get_tensor(f"model.layers.{i}.mlp.down_proj.weight"),
                   theirs[main + "decoder.layers.mlp.linear_fc2.weight"][i]) for i in range(2)]
    for got, want in pairs:
        assert got.dtype == torch.float32 and torch.equal(got, want)
    assert not torch.equal(pairs[0][1], pairs[0][1].bfloat16().float())  # the main params are not bf16 values


def _edited(src: pathlib.Path, tmp: pathlib.Path, edit) -> pathlib.Path:
    import shutil

    out = tmp / "ckpt"
    shutil.copytree(src, out)
    path = next(out.glob("iter_*")) / "common.pt"
    with torch.serialization.safe_globals([argparse.Namespace]):  # written by megatron-core here
        common = torch.load(path, weights_only=False)
    edit(common["optimizer"])
    torch.save(common, path)
    return out


def _flatten(optim: dict) -> None:  # FP32Optimizer's form over bf16 params
    optim.update(optim.pop("optimizer"))


@pytest.mark.parametrize("edit,message", [
    (_flatten, r"over bfloat16 params is Float16OptimizerWithFloat16Params' \{optimizer: \{state, "
               r"param_groups\}\} in megatron-core; found the entries \['param_groups', 'state'\]"),
    (lambda o: o.update(fp32_from_fp16_params=[[torch.zeros(2)]]),
     r"fp32_from_fp16_params holds Tensor values; expected its tensors as DCP items"),
    (lambda o: o.update(optimizer=[1]), r"optimizer.optimizer is list; expected a dict"),
    (lambda o: o.update(optimizer={}, fp32_from_fp16_params=[]),
     r"the optimizer entry has no state or param_groups \(found the entries \['fp32_from_fp16_params', "
     r"'optimizer'\]\)"),
], ids=["fp32-form", "main-params-in-common", "not-a-dict", "no-groups"])
def test_a_lying_optimizer_entry_is_refused(src, tmp_path, edit, message):
    import re

    ckpt = _edited(src, tmp_path, edit)
    done = run_cli(["inspect", str(ckpt)], cwd=tmp_path, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-2000:]
    assert "common.pt" in lines[0] and re.search(message, lines[0]), lines[0]
