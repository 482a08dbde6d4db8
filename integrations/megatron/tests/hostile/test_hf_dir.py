"""Issue 20: a Hugging Face source whose safetensors header lies relative to its bytes.

A model saved by ``transformers`` (real ``save_pretrained``), then one header entry pointed at
another tensor's bytes (same size, so every size check passes). The safetensors library refuses
such a file; tenplex read the second tensor's values for the first and exited 0 (79514cb:
``tenplex reshard ... --format megatron-dist`` wrote the output; this test failed there with
``DID NOT RAISE``). Now it is refused naming the file and both tensors, nothing written.
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest

import tenplex
from tenplex.errors import CorruptShardError


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("hf") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _share_bytes(path) -> tuple[str, str]:
    """Point a tensor's offsets at the bytes of another of the same size; returns both names."""
    file = path / "model.safetensors"
    blob = file.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    names = [k for k in header if k != "__metadata__"]
    size = {k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0] for k in names}
    a, b = next((a, b) for a in names for b in names if a < b and size[a] == size[b])
    header[b]["data_offsets"] = header[a]["data_offsets"]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + blob[8 + n:])
    return a, b


def test_tensors_sharing_bytes_in_an_hf_file_are_refused(hf_model, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hf_model, src)
    a, b = _share_bytes(src)
    out = tmp_path / "out"
    with pytest.raises(CorruptShardError, match=r"model\.safetensors: tensors .* share bytes") as info:
        tenplex.reshard(str(src), str(out), tenplex.ParallelConfig(), format="megatron-dist")
    assert a in str(info.value) and b in str(info.value)
    assert not out.exists()
    with pytest.raises(CorruptShardError, match=r"share bytes"):
        tenplex.verify(str(src), progress=False)


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 2**40), ("num_local_experts", 2**24),
                                        ("vocab_size", 10**12), ("num_key_value_heads", -1)])
def test_a_huge_count_in_config_json_is_refused_under_its_own_name(hf_model, tmp_path, key, value):
    # 79514cb named Megatron's field ("MegatronConfig: args.num_layers"), not the file's key
    from tenplex.errors import ConfigError

    src = tmp_path / "src"
    shutil.copytree(hf_model, src)
    config = json.loads((src / "config.json").read_text())
    config[key] = value
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=rf"config\.json: {key}: expected an integer in \[0, \d+\]"):
        tenplex.reshard(str(src), str(out), tenplex.ParallelConfig(), format="megatron-dist")
    assert not out.exists()
