"""Unit tests of the Megatron integration that need no megatron-core processes."""

import argparse
import json

import pytest
import torch

from tenplex.errors import ConfigError, CorruptShardError, ManifestError
from tenplex.ptree.config import ParallelConfig
from tenplex_megatron.model.config import MegatronConfig, stage_layers, uneven_args
from tenplex_megatron.model.vocab import check_target_vocab
from tenplex_megatron.model.unmodeled import UNMODELED
from tenplex_megatron.torchfiles.jsonable import from_jsonable, to_jsonable
from tenplex_megatron.model.layouts import check_attention_tp, megatron_tree, param_specs, rank_keys
from tenplex_megatron.model.rng import derive
from tenplex_megatron.torchfiles.safe_load import safe_load

CFG = MegatronConfig(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                     ffn_hidden_size=96, swiglu=True, vocab_size=100, make_vocab_size_divisible_by=16,
                     position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                     add_bias_linear=False, normalization="RMSNorm")


def test_stage_local_names_map_to_global_layers():
    keys = rank_keys(CFG, ParallelConfig(tp=1, pp=2), 1)
    assert keys["model/decoder/layers/2/mlp/linear_fc1/weight"][0] == "decoder.layers.0.mlp.linear_fc1.weight"
    assert "language_model.encoder.layers.0.mlp.dense_h_to_4h.weight" in \
        keys["model/decoder/layers/2/mlp/linear_fc1/weight"]
    assert "model/embedding/word_embeddings/weight" not in keys
    uneven = ParallelConfig(tp=1, pp=2, stage_layers=(1, 3))
    assert "model/decoder/layers/1/mlp/linear_fc1/weight" in rank_keys(CFG, uneven, 1)


def test_tied_last_stage_reads_the_output_layer_as_the_embedding():
    tied = MegatronConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64)
    keys = rank_keys(tied, ParallelConfig(pp=2), 1)
    assert keys["model/embedding/word_embeddings/weight"] == ["output_layer.weight",
                                                              "word_embeddings_for_head.weight"]


def test_layouts_follow_megatron():
    tree = megatron_tree(CFG, optimizer=True)
    qkv = tree["model/decoder/layers/0/self_attention/linear_qkv/weight"]
    assert qkv.shape == ((8 + 2 * 2) * 8, 64) and qkv.layout.split.granularity == 1  # tp may exceed groups
    fc1 = tree["model/decoder/layers/0/mlp/linear_fc1/weight"]
    assert fc1.layout.split.parts == (96, 96)
    tree.validate(ParallelConfig(tp=4))  # 8 heads, 2 groups: megatron-core runs tp=4 (issue 19.5)
    check_attention_tp(CFG, 4)
    with pytest.raises(ConfigError, match="tp=3 does not divide num_attention_heads=8"):
        tree.validate(ParallelConfig(tp=3))
    with pytest.raises(ConfigError, match="tp=4 does not divide num_query_groups=6, nor is a multiple"):
        check_attention_tp(MegatronConfig(num_layers=1, hidden_size=96, num_attention_heads=12,
                                          num_query_groups=6, vocab_size=100), 4)
    assert [s.path for s in param_specs(CFG)][:3] == [
        "model/embedding/word_embeddings/weight", "model/decoder/layers/0/input_layernorm/weight",
        "model/decoder/layers/0/self_attention/linear_proj/weight"]


def test_config_from_args_needs_the_logical_vocab():
    args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=128)
    with pytest.raises(ConfigError, match="no vocab_size; pass the tokenizer's vocabulary size"):
        MegatronConfig.from_args(args)
    assert MegatronConfig.from_args(args, {"vocab_size": 100}).vocab_size == 100
    assert MegatronConfig.from_args(args, {"vocab_size": 100}).vocab_padded_from is None


def test_config_from_args_with_the_padded_vocab_only():
    """Megatron-LM's args with a real tokenizer: the padded rows stand for the vocabulary, and a target
    tp whose padding depends on the tokenizer's size is refused (GPT-2's 50257 tokens: 50304 rows at
    tp 1, 50432 at tp 2)."""
    args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=50432,
                              tensor_model_parallel_size=2, make_vocab_size_divisible_by=128)
    cfg = MegatronConfig.from_args(args)
    assert (cfg.vocab_size, cfg.vocab_padded_from) == (50432, 256)
    assert MegatronConfig.from_json(cfg.to_json()) == cfg
    for tp in (2, 4, 8):
        check_target_vocab(cfg, tp)
    with pytest.raises(ConfigError, match=r"50177\.\.50432 tokens pad to 50304 to 50432 rows at tp=1"):
        check_target_vocab(cfg, 1)
    check_target_vocab(MegatronConfig.from_args(args, {"vocab_size": 50257}), 1)
    with pytest.raises(ConfigError, match="make_vocab_size_divisible_by=0; expected at least 1"):
        MegatronConfig.from_args({**vars(args), "make_vocab_size_divisible_by": 0})  # was ZeroDivisionError
    assert MegatronConfig.from_args({**vars(args), "make_vocab_size_divisible_by": None}).vocab_padded_from == 256
    assert MegatronConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100,
                          make_vocab_size_divisible_by=16).padded_vocab(2) == 128


def test_uneven_pipeline_args():
    args = argparse.Namespace(decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=3)
    assert stage_layers(args, 8, 3) == (1, 4, 3)
    assert uneven_args((1, 4, 3)) == {"decoder_first_pipeline_num_layers": 1,
                                      "decoder_last_pipeline_num_layers": 3}
    with pytest.raises(ConfigError, match="uneven first and last stages only"):
        uneven_args((1, 2, 3, 2))
    with pytest.raises(ConfigError, match="leave 5 layers for 2 middle stages"):
        stage_layers(argparse.Namespace(decoder_first_pipeline_num_layers=3), 8, 3)


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_unsafe_pickles_are_refused(tmp_path):
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"model": {}, "evil": Evil()}, path)
    with pytest.raises(ManifestError, match="refusing unsafe unpickling"):
        safe_load(path)
    ok = tmp_path / "ok.pt"
    torch.save({"args": argparse.Namespace(a=1), "t": torch.ones(2)}, ok)
    assert safe_load(ok)["args"].a == 1


def test_rng_state_round_trips_through_json():
    state = [derive(1234, tp_rank=1, pp_rank=0, kind="cpu")]
    back = from_jsonable(json.loads(json.dumps(to_jsonable(state))))
    assert torch.equal(back[0]["torch_rng_state"], state[0]["torch_rng_state"])
    assert back[0]["random_rng_state"] == state[0]["random_rng_state"]
    assert (back[0]["np_rng_state"][1] == state[0]["np_rng_state"][1]).all()


def test_derived_rng_states_fit_their_generators():
    """CPU kind: valid Mersenne-Twister states seeded as Megatron seeds; CUDA kind: 16-byte Philox
    (seed, offset 0) states, which a CPU generator refuses (torch's CUDAGeneratorImpl::get_state)."""
    import struct

    from tenplex_megatron.model.rng import device_kind

    base = 1234 + 100 * 2
    cpu = derive(1234, tp_rank=1, pp_rank=2, kind="cpu")
    torch.Generator().set_state(cpu["cuda_rng_state"])
    assert torch.equal(cpu["rng_tracker_states"]["model-parallel-rng"],
                       torch.Generator().manual_seed(base + 2718 + 1).get_state())
    cuda = derive(1234, tp_rank=1, pp_rank=2, kind="cuda")
    tracker = cuda["rng_tracker_states"]
    for state, seed in [(cuda["cuda_rng_state"], base), (tracker["data-parallel-rng"], base),
                        (tracker["model-parallel-rng"], base + 2718 + 1),
                        (tracker["expert-parallel-rng"], base + 1024)]:
        assert state.dtype == torch.uint8 and state.numel() == 16
        assert struct.unpack("<Qq", bytes(state.tolist())) == (seed, 0)
    with pytest.raises(RuntimeError):
        torch.Generator().set_state(cuda["cuda_rng_state"])
    assert torch.equal(cuda["torch_rng_state"], cpu["torch_rng_state"])  # the CPU generator either way
    assert device_kind([cpu]) == "cpu" and device_kind([cuda]) == "cuda" and device_kind({}) == "cuda"


def test_tracker_names_are_megatron_cores():
    from megatron.core.tensor_parallel import random as mrandom

    from tenplex_megatron.model.rng import TRACKER_NAMES

    names = {mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, mrandom._DATA_PARALLEL_RNG_TRACKER_NAME,
             mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME}
    assert set(TRACKER_NAMES) == names == set(derive(1, 0, 0)["rng_tracker_states"])


def test_rng_states_are_kept_by_coordinate_and_derived_where_new():
    from tenplex_megatron.model.rng import fill_states

    kept = [derive(7, 0, 0, kind="cpu")]
    states, notes = fill_states({"tp=0,pp=0": kept, "tp=1,pp=0": None}, [(0, 0), (1, 0)], 2, seed=7,
                                dp_random_init=False, kind="cpu")
    assert states["tp=0,pp=0"] is not kept and states["tp=0,pp=0"][0] is kept[0]
    assert torch.equal(states["tp=1,pp=0"][0]["rng_tracker_states"]["model-parallel-rng"],
                       derive(7, 1, 0, kind="cpu")["rng_tracker_states"]["model-parallel-rng"])
    assert notes == ["rng: tp=1,pp=0 is a new coordinate; its state is derived from seed 7"]
    states, notes = fill_states({"tp=0,pp=0": kept}, [(0, 0)], 2, seed=7, dp_random_init=True, kind="cpu")
    assert len(states["tp=0,pp=0"]) == 2 and "missing ones derived" in notes[0]
    _, notes = fill_states({}, [(0, 0)], 1, seed=7, dp_random_init=False, kind="cuda")
    assert notes == ["rng: the source stores no RNG state; every rank's state is derived from seed 7"]


def test_jsonable_round_trips_exactly():
    import numpy as np

    obj = {"a": (1, [2.5, None]), "t": torch.arange(6, dtype=torch.uint8).view(2, 3),
           "n": np.arange(4, dtype=np.uint32), "d": torch.bfloat16, "s": "x"}
    back = from_jsonable(json.loads(json.dumps(to_jsonable(obj))))
    assert back["a"] == (1, [2.5, None]) and back["d"] is torch.bfloat16 and back["s"] == "x"
    assert torch.equal(back["t"], obj["t"]) and back["t"].shape == (2, 3)
    assert back["n"].dtype == np.uint32 and (back["n"] == obj["n"]).all()
    with pytest.raises(ManifestError, match="a Evil cannot be kept as JSON"):
        to_jsonable({"x": Evil()})


def test_tensor_refs_read_only_what_is_asked(tmp_path):
    import numpy as np

    from tenplex_megatron.torchfiles.ptfile import load_refs

    w = torch.randn(1024, 256)  # 1 MiB: the two runs below lie more than ptfile.GAP apart
    torch.save({"w": w, "args": argparse.Namespace(x=1)}, tmp_path / "a.pt")
    obj, n = load_refs(str(tmp_path / "a.pt"))
    # the zip directory and pickle, read twice (validated, then loaded on the meta device)
    assert obj["args"].x == 1 and n < 16384 < w.numel() * 4
    ref = obj["w"]
    got, read = ref.read(np.array([1024, 900000]), np.array([2048, 900004]))
    assert read == 1024 + 4
    assert torch.equal(got.view(-1)[256:512], w.view(-1)[256:512]) and got.view(-1)[225000] == w.view(-1)[225000]
    torch.save({"t": torch.ones(3, 4).t()}, tmp_path / "b.pt")
    with pytest.raises(ManifestError, match="not row-major"):
        load_refs(str(tmp_path / "b.pt"))
    data = (tmp_path / "a.pt").read_bytes()
    (tmp_path / "c.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptShardError, match="not a torch zip archive"):
        load_refs(str(tmp_path / "c.pt"))
    # torch.save's format before 1.6: named as such, with the way out, not as a corrupt zip
    torch.save({"w": w[:2]}, tmp_path / "d.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(CorruptShardError, match=r"d.pt: a torch.save file in the format before torch 1.6 .*"
                                                r"torch.save it again with torch >= 1.6"):
        load_refs(str(tmp_path / "d.pt"))


def test_dcp_records_mirror_torch_classes():
    """tenplex's copies of DCP's records (read without importing DCP) have torch's field names,
    defaults, equality and enum values, so a torch upgrade that changes them fails here."""
    import dataclasses
    import enum
    import importlib

    from tenplex_megatron.dcp.records import TORCH_NAMES, MetadataIndex

    def default(f):
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    for ours, (module, name) in TORCH_NAMES.items():
        theirs = getattr(importlib.import_module(module), name)
        if issubclass(ours, enum.Enum):
            assert {m.name: m.value for m in ours} == {m.name: m.value for m in theirs}, name
            continue
        mine, torchs = dataclasses.fields(ours), dataclasses.fields(theirs)
        assert [(f.name, default(f), f.compare, f.hash) for f in mine] == \
            [(f.name, default(f), f.compare, f.hash) for f in torchs], name
    from torch.distributed.checkpoint.metadata import MetadataIndex as TorchIndex
    for args in (("a",), ("a", (0, 4)), ("a", [0, 4], 3)):
        assert hash(MetadataIndex(*args)) == hash(TorchIndex(*args))
        assert MetadataIndex(*args) == MetadataIndex(args[0], *args[1:2])


@pytest.mark.parametrize("flag,value", [(name, "learnable" if name == "softmax_type" else
                                          "M-M*" if name == "hybrid_override_pattern" else 1)
                                         for name, _, _ in UNMODELED])
def test_args_of_models_tenplex_does_not_model_are_refused_by_name(flag, value):
    """A model with parameters tenplex does not model is refused naming the flag (before: the first
    unexpected tensor's key); the flag at its Megatron-LM default passes."""
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100)
    with pytest.raises(ConfigError, match=rf"Megatron args: {flag}=.* which tenplex does not model") as info:
        MegatronConfig.from_args({**base, flag: value})
    assert "\n" not in str(info.value)
    default = "vanilla" if flag == "softmax_type" else None
    assert MegatronConfig.from_args({**base, flag: default}).num_layers == 2


def test_pipeline_splits_that_count_the_embedding_and_loss():
    """megatron-core's get_num_layers_to_build: the embedding (loss) takes one layer's place on the
    first (last) stage; with virtual stages, or a pipeline_model_parallel_layout, it is refused by name."""
    def split(layers, pp, **args):
        return stage_layers(argparse.Namespace(**args), layers, pp)

    assert split(3, 2, account_for_embedding_in_pipeline_split=True) == (1, 2)
    assert split(6, 4, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True) \
        == (1, 2, 2, 1)
    assert split(5, 2, account_for_loss_in_pipeline_split=True) == (3, 2)
    assert split(4, 2, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True) \
        is None  # (2, 2): even
    assert split(4, 1, account_for_embedding_in_pipeline_split=True) is None
    with pytest.raises(ConfigError, match="do not split evenly over pp=2"):
        split(4, 2, account_for_embedding_in_pipeline_split=True)
    with pytest.raises(ConfigError, match="with vpp=2 shortens the first or last virtual stage"):
        split(7, 2, account_for_embedding_in_pipeline_split=True, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ConfigError, match="pipeline_model_parallel_layout=Et|tL"):
        split(2, 2, pipeline_model_parallel_layout="Et|tL")
