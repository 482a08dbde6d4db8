"""A model directory whose weights are not safetensors is named as such, not "not a checkpoint".

transformers wrote ``pytorch_model.bin`` (``torch.save`` of the state dict) before safetensors became
its default (v4.35), and many Hub models still have only that. The hf format reads safetensors only;
every command says what the directory holds and what to do. (On the old code: "not a checkpoint of
any known format".)
"""

import torch
from safetensors.torch import load_file

from inprocess_cli import run_cli


def _llama(root):
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(root))
    return root


def test_pickled_or_missing_weights_are_named(tmp_path):
    pickled = _llama(tmp_path / "bin")
    torch.save(load_file(str(pickled / "model.safetensors")), pickled / "pytorch_model.bin")  # transformers < 4.35
    (pickled / "model.safetensors").unlink()
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((pickled / "config.json").read_bytes())
    expected = "a Hugging Face model directory (config.json) without safetensors weights: expected " \
               "model.safetensors or model.safetensors.index.json, found "
    for src, tail in ((pickled, "'pytorch_model.bin'; its weights are PyTorch pickles, which the hf format "
                               "does not read"), (bare, "'config.json'")):
        for args in (["inspect", str(src)], ["reshard", str(src), str(tmp_path / "out"), "--to", "tp=2",
                                            "--format", "megatron-dist"]):
            done = run_cli(args)
            assert done.returncode == 1 and expected in done.stderr and tail in done.stderr, (args, done.stderr)
            assert not (tmp_path / "out").exists()
