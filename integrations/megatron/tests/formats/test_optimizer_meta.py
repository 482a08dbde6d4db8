"""A legacy file's optimizer entry: the fp16 grad scaler is read at describe time, and bounded."""

from __future__ import annotations

import pytest
import torch

from tenplex.errors import ManifestError
from tenplex_megatron.formats.legacy.optimizer_meta import SCALER_NUMEL, optimizer_meta
from tenplex_megatron.torchfiles.jsonable import from_jsonable
from tenplex_megatron.torchfiles.ptfile import TensorRef


def _entry(scale: TensorRef) -> dict:  # Float16OptimizerWithFloat16Params.state_dict(), tensors as refs
    return {"optimizer": {"state": {}, "param_groups": [{"lr": 1e-3, "params": [0]}]},
            "fp32_from_fp16_params": [[]], "grad_scaler": {"scale": scale, "growth_tracker": 3,
                                                           "hysteresis_tracker": 2}}


def test_the_grad_scaler_is_read_and_its_bytes_counted(tmp_path):
    f = tmp_path / "model_optim_rng.pt"
    f.write_bytes(b"\0" * 8 + torch.tensor([1024.0]).numpy().tobytes())
    read: list[int] = []
    meta = optimizer_meta(_entry(TensorRef(str(f), 8, (1,), torch.float32)), str(f), read.append)
    scaler = from_jsonable(meta["grad_scaler"])
    assert torch.equal(scaler["scale"], torch.tensor([1024.0])) and read == [4]
    assert (scaler["growth_tracker"], scaler["hysteresis_tracker"]) == (3, 2)
    assert meta["param_groups"] == [{"lr": 1e-3}]


def test_a_large_grad_scaler_tensor_is_refused_unread(tmp_path):
    f = tmp_path / "model_optim_rng.pt"
    f.write_bytes(b"\0" * 4)  # far shorter than the tensor claims: nothing may be read
    big = TensorRef(str(f), 0, (SCALER_NUMEL + 1, 1 << 30), torch.float32)
    read: list[int] = []
    with pytest.raises(ManifestError, match=rf"grad_scaler.scale: a \[{SCALER_NUMEL + 1}, 1073741824\] tensor; "
                                            r"a grad scaler holds tensors of at most"):
        optimizer_meta(_entry(big), str(f), read.append)
    assert read == []
