"""The Megatron formats (legacy, torch_dist, hf) join the format conformance suite (tenplex.formats.conformance).

The source is a tenplex store of a Megatron GPT tree with random tensors and
the value leaves a Megatron checkpoint carries, so the suite runs in seconds
without megatron-core. The megatron-core torchrun tests stay the oracle for
what megatron-core itself writes and loads.
"""

from __future__ import annotations

import glob
import os

from tenplex.formats.conformance import FormatConformance
from tenplex.models import random_state
from tenplex.ptree.config import ParallelConfig
from tenplex_megatron.formats.hf.plugin import HF
from tenplex_megatron.formats.plugin import DIST, LEGACY
from tenplex_megatron.model.config import MegatronConfig
from tenplex_megatron.model.layouts import megatron_tree

CFG = MegatronConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100,
                     ffn_hidden_size=64, num_query_groups=2)
ARGS = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 100,
        "ffn_hidden_size": 64, "group_query_attention": True, "num_query_groups": 2,
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
        "make_vocab_size_divisible_by": 128}


class _Megatron(FormatConformance):
    source_config = ParallelConfig(dp=1, tp=2, pp=1)
    target_config = ParallelConfig(dp=1, tp=1, pp=2)

    def make_tree(self):
        return megatron_tree(CFG)

    def make_state(self, tree, config):
        state = random_state(tree, config, seed=7)
        state.update({"megatron/iteration": 5, "megatron/checkpoint_version": 3.0, "megatron/args": ARGS,
                      "megatron/opt_param_scheduler": None, "megatron/optimizer": None,
                      "megatron/num_floating_point_operations_so_far": 0,
                      "megatron/extra": None})
        return state

    def meta(self, tree):
        return {"megatron": {"format": "legacy", "config": CFG.to_json(), "optimizer": None,
                             "buffer_dtypes": None}}


class TestLegacyFormat(_Megatron):
    format = LEGACY

    def metadata_file(self, path: str) -> str:
        return sorted(glob.glob(f"{path}/iter_*/mp_rank_*/model_optim_rng.pt"))[0]


class TestDistFormat(_Megatron):
    format = DIST

    def metadata_file(self, path: str) -> str:
        return glob.glob(f"{path}/**/.metadata", recursive=True)[0]


def test_a_megatron_to_store_reshard_builds_one_sharding_per_config(tmp_path, monkeypatch):
    """The reader's sharding travels with its description into the source and the plan; the plan's
    reaches the store executor and the writer: one ``Sharding`` per config per reshard."""
    import tenplex
    from tenplex.ptree import sharding as sharding_module
    from tenplex.ptree.shards import materialize
    from tenplex.store.reader import StoreReader
    from tenplex.store.writer import save

    for case in (TestLegacyFormat(), TestDistFormat()):
        tree, src = case.make_tree(), case.source_config
        state = case.make_state(tree, src)
        root = tmp_path / case.format.name
        save(str(root / "a"), tree, src, {r: materialize(tree, state, src, r) for r in range(src.world_size)},
             meta=case.meta(tree))
        case.format.write(StoreReader(str(root / "a")), str(root / "m"), case.target_config)
        built, real = [], sharding_module.Sharding.__init__

        def counting(self, tree, config, real=real, built=built):
            built.append(str(config))
            real(self, tree, config)

        monkeypatch.setattr(sharding_module.Sharding, "__init__", counting)
        to = ParallelConfig(dp=1, tp=2, pp=1)
        tenplex.reshard(str(root / "m"), str(root / "out"), to, format="tenplex")
        monkeypatch.setattr(sharding_module.Sharding, "__init__", real)
        assert sorted(built) == sorted([str(case.target_config), str(to)]), (case.format.name, built)


HF_CFG = MegatronConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, ffn_hidden_size=64,
                        num_query_groups=2, swiglu=True, untie_embeddings_and_output_weights=True,
                        position_embedding_type="rope", add_bias_linear=False, normalization="RMSNorm")
HF_ARGS = {**ARGS, "swiglu": True, "untie_embeddings_and_output_weights": True, "position_embedding_type": "rope",
           "add_bias_linear": False, "normalization": "RMSNorm", "norm_epsilon": 1e-5, "rotary_base": 10000,
           "tensor_model_parallel_size": 2}


class TestHFFormat(_Megatron):
    """The ``hf`` format (an export, read back by the import) from a tp = 2 Llama-like tree.

    Safetensors files keep no checksums: ``verify`` checks structure (each header against its
    file's size, the index against the headers), so a flipped data byte is declared not found
    and a flipped header-length, header or index byte must be found (docs/hf.md, "Verify").
    """

    format = HF
    target_config = ParallelConfig()
    verify_checks_data = False

    def make_tree(self):
        return megatron_tree(HF_CFG)

    def make_state(self, tree, config):
        state = super().make_state(tree, config)
        state["megatron/args"] = HF_ARGS
        return state

    def meta(self, tree):
        return {"megatron": {"format": "legacy", "config": HF_CFG.to_json(), "optimizer": None,
                             "buffer_dtypes": None}}

    def metadata_file(self, path: str) -> str:
        return f"{path}/config.json"

    def structure_bytes(self, path: str) -> list[tuple[str, int]]:
        import struct

        shard = sorted(glob.glob(f"{path}/*.safetensors"))[0]
        with open(shard, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        index = f"{path}/model.safetensors.index.json"
        return [(shard, 0), (shard, 8 + n // 2), (index, os.path.getsize(index) // 2)]
