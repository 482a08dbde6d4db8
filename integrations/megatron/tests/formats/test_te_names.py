"""TransformerEngine names (issue 19, failure 2), in legacy and torch_dist, dense and MoE.

TE does not run on CPU, so megatron-core 0.16.1 builds the local-spec model and its checkpoints get
TE's names from megatron-core's own map (``te_names.te_prefixes``: each layer's
``sharded_state_dict_keys_map``), never from a table written by hand: legacy files hold
``self_attention.linear_qkv.layer_norm_weight`` / ``mlp.linear_fc1.layer_norm_weight`` and TE's empty
extra states (``core_attention._extra_state`` too); with experts, TE's separate
``pre_mlp_layernorm`` in both formats. tenplex reshards them, keeps the names by default (or writes
the other scheme when asked), and megatron-core loads every output with the source's logits
within 2e-6; tenplex's own scheme table is compared with megatron-core's map.

On e4220c6: ``key decoder.layers.0.input_layernorm.weight ... is missing`` (legacy) and
``tensor decoder.layers.mlp.linear_fc1.layer_norm_weight is missing`` (MoE torch_dist).
"""

import os
import subprocess

import pytest
import torch

from mcore_helpers import logits, torchrun
from moe_cases import WORKER

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

DENSE = ("--layers 2 --hidden 64 --heads 4 --query-groups 2 --ffn 96 --swiglu --position rope --untie "
         "--vocab 128 --make-vocab-size-divisible-by 16 --seq 8 --batch 4 --names te")
MOE = DENSE + " --experts 4 --topk 2"


def run(n: int, flags: str, *extra: str) -> str:
    return torchrun(WORKER, n, [*flags.split(), *extra])


def tenplex(*args: str) -> None:
    done = subprocess.run(["tenplex", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def model_keys(root) -> set[str]:
    """The model keys of a legacy root's first rank file."""
    it = open(os.path.join(root, "latest_checkpointed_iteration.txt")).read().strip()
    d = os.path.join(root, f"iter_{int(it):07d}")
    first = sorted(os.listdir(d))[0]
    return set(torch.load(os.path.join(d, first, "model_optim_rng.pt"), weights_only=False)["model"])


def dist_keys(root) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    from mcore_checkpoint import megatron_load_dir

    return set(FileSystemReader(megatron_load_dir(str(root))).read_metadata().state_dict_metadata)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("te")
    run(2, DENSE + " --tp 2", "--save", "both", "--save-dir", str(d / "dense"), "--logits-out", str(d / "dense.pt"))
    run(2, MOE + " --ep 2", "--save", "both", "--save-dir", str(d / "moe"), "--logits-out", str(d / "moe.pt"))
    return d


def test_the_sources_carry_te_names(saved):
    dense, moe = model_keys(saved / "dense" / "legacy"), model_keys(saved / "moe" / "legacy")
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in dense
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in dense
    assert "decoder.layers.0.self_attention.core_attention._extra_state" in dense
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in dense)
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in moe  # TE's MoE layer keeps it separate
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in moe
    assert "decoder.layers.pre_mlp_layernorm.weight" in dist_keys(saved / "moe" / "dist")


def test_te_names_reshard_keep_their_scheme_and_load(saved, tmp_path):
    cases = [  # (source, target format, --to, model flags and world at the target, load as)
        (saved / "dense" / "legacy", "megatron-legacy", "tp=1", DENSE, 1, "legacy", "dense"),
        (saved / "dense" / "legacy", "megatron-dist", "tp=1", DENSE, 1, "dist", "dense"),
        (saved / "moe" / "legacy", "megatron-legacy", "dp=1", MOE, 1, "legacy", "moe"),
        (saved / "moe" / "dist", "megatron-dist", "dp=1", MOE, 1, "dist", "moe"),  # direct
        (saved / "moe" / "dist", "megatron-legacy", "dp=2,ep=2", MOE + " --ep 2", 2, "legacy", "moe"),
    ]
    for i, (src, fmt, to, flags, n, load_as, model) in enumerate(cases):
        out = tmp_path / f"out{i}"
        tenplex("reshard", str(src), str(out), "--to", to, "--format", fmt)
        if fmt == "megatron-legacy":
            keys = model_keys(out)
            assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in keys
            assert "decoder.layers.0.self_attention.core_attention._extra_state" in keys
            assert ("decoder.layers.0.pre_mlp_layernorm.weight" in keys) == (model == "moe")
        else:
            assert ("decoder.layers.pre_mlp_layernorm.weight" in dist_keys(out)) == (model == "moe")
        run(n, flags, "--seed", "7", "--load", load_as, "--load-dir", str(out), "--loaded-logits-out", str(tmp_path / f"got{i}.pt"),
            "--fresh-logits-out", str(tmp_path / f"fresh{i}.pt"))
        ref = logits(saved / f"{model}.pt")
        assert (logits(tmp_path / f"got{i}.pt") - ref).abs().max().item() <= 2e-6, cases[i]
        assert (logits(tmp_path / f"fresh{i}.pt") - ref).abs().max().item() > 1e-3, cases[i]


def test_the_other_scheme_on_request(saved, tmp_path):
    from tenplex.ptree.config import ParallelConfig
    from tenplex_megatron.formats.plugin import DIST, LEGACY

    source = DIST.open_source(str(saved / "moe" / "dist"))
    assert source.meta["megatron"]["names"] == "te"
    LEGACY.write(source, str(tmp_path / "local"), ParallelConfig(), names="local")
    keys = model_keys(tmp_path / "local")
    assert "decoder.layers.0.input_layernorm.weight" in keys and "decoder.layers.0.pre_mlp_layernorm.weight" in keys
    assert not any("core_attention" in k for k in keys)
    run(1, MOE.replace("--names te", "--names local"), "--seed", "7", "--load", "legacy", "--load-dir", str(tmp_path / "local"),
        "--loaded-logits-out", str(tmp_path / "got.pt"))
    assert (logits(tmp_path / "got.pt") - logits(saved / "moe.pt")).abs().max().item() <= 2e-6


def test_the_scheme_table_is_megatron_cores_map():
    """tenplex's TE names (model/layouts.TE_KEYS_MAP) are megatron-core's local spec's own map."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tenplex_megatron.model.config import MegatronConfig
    from tenplex_megatron.model.layouts import TE_KEYS_MAP, param_specs

    assert get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map == TE_KEYS_MAP
    cfg = MegatronConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=128)
    te = {s.mcore: s.te for s in param_specs(cfg) if s.te}
    assert te == {"decoder.layers.{i}.input_layernorm.weight": "decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight",
                  "decoder.layers.{i}.input_layernorm.bias": "decoder.layers.{i}.self_attention.linear_qkv.layer_norm_bias",
                  "decoder.layers.{i}.pre_mlp_layernorm.weight": "decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight",
                  "decoder.layers.{i}.pre_mlp_layernorm.bias": "decoder.layers.{i}.mlp.linear_fc1.layer_norm_bias"}
