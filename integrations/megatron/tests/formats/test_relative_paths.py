"""Checkpoints named by relative paths, as users type them: ``tenplex inspect ckpt/legacy``.

The path rule (``tenplex.store.paths.resolve_inside``) joined a relative file path to its root a
second time, so a Megatron ``--save`` root, a ``torch_dist`` folder and a Hugging Face directory
named relatively were "not a checkpoint of any known format" (the tracker was looked for at
``ckpt/legacy/ckpt/legacy/latest_checkpointed_iteration.txt``) or missed their ``.metadata``.
Every test before used absolute temporary paths.
"""

import os

import torch

from tenplex.api import load_global
from tenplex.cli.main import main


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k
        else:
            assert a[k] == b[k], k


def test_relative_paths_read_write_and_verify_as_absolute_ones(sources, tmp_path, monkeypatch, capsys):
    src = sources("mha", 2, 1)
    monkeypatch.chdir(tmp_path)
    rel = os.path.relpath(src, tmp_path)  # ../../mcore0/mha-tp2-pp1
    for kind, fmt in (("legacy", "megatron-legacy"), ("dist", "megatron-dist")):
        assert main(["inspect", f"{rel}/{kind}"]) == 0, capsys.readouterr().err
        assert f"{fmt} checkpoint" in capsys.readouterr().out
        assert main(["reshard", f"{rel}/{kind}", f"{kind}-rel", "--to", "tp=1", "--format", "tenplex"]) == 0
        assert main(["reshard", str(src / kind), str(tmp_path / f"{kind}-abs"), "--to", "tp=1",
                     "--format", "tenplex"]) == 0
        _same(load_global(f"{kind}-rel"), load_global(str(tmp_path / f"{kind}-abs")))
    gqa = os.path.relpath(sources("gqa", 1, 1), tmp_path)  # a model Hugging Face's families express
    assert main(["reshard", f"{gqa}/legacy", "hf", "--format", "hf"]) == 0  # a relative HF directory
    assert main(["verify", "hf"]) == 0 and main(["inspect", "hf"]) == 0
    assert main(["reshard", "hf", "back", "--to", "tp=2", "--format", "megatron-dist"]) == 0
    assert main(["verify", "back"]) == 0, capsys.readouterr().err
