"""The torch-file reader works with the zip reader of every torch it supports, not only the newest.

torch 2.11's ``torch._C.PyTorchFileReader`` has no ``get_record_size`` (seen on a GPU machine with
torch 2.11.0+cu130: ``tenplex verify`` of a real Megatron-LM legacy checkpoint failed with
``AttributeError``). Record sizes now come from the archive's zip directory; this test hides the
method, as such a torch would, and fails on e776760 with that ``AttributeError``.
"""

import io

import torch

from tenplex_megatron.torchfiles import safe_load as safe_load_module
from tenplex_megatron.torchfiles.safe_load import safe_load


_TORCH_READER = torch._C.PyTorchFileReader


class _ReaderWithoutRecordSize:
    """torch's zip reader as torch 2.11 offers it: everything but ``get_record_size``."""

    def __init__(self, f):
        self._reader = _TORCH_READER(f)

    def __getattr__(self, name):
        if name == "get_record_size":
            raise AttributeError(f"'torch._C.PyTorchFileReader' object has no attribute '{name}'")
        return getattr(self._reader, name)


def test_a_torch_file_loads_without_the_readers_record_size(monkeypatch, tmp_path):
    state = {"model": {"w": torch.randn(8, 4), "b": torch.arange(3, dtype=torch.bfloat16)}, "iteration": 7}
    path = tmp_path / "model_optim_rng.pt"
    torch.save(state, path)
    monkeypatch.setattr(safe_load_module.torch._C, "PyTorchFileReader", _ReaderWithoutRecordSize)
    for source in (str(path), io.BytesIO(path.read_bytes())):
        got = safe_load(source, "model_optim_rng.pt")
        assert got["iteration"] == 7
        assert all(torch.equal(got["model"][k], v) for k, v in state["model"].items())
