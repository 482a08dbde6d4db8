"""Checkpoints whose args hold the padded vocabulary only: what Megatron-LM writes with a real tokenizer.

Megatron-LM sets ``args.vocab_size`` for the NullTokenizer only; with GPT2BPETokenizer,
HuggingFaceTokenizer and the others the args hold ``padded_vocab_size`` (the tokenizer's size
padded to a multiple of ``make_vocab_size_divisible_by * tp``). On 30f0678 tenplex refused every
such checkpoint until the user gave the tokenizer's size ("no vocab_size; pass the tokenizer's
vocabulary size"). Now it reshards to any config whose padding does not depend on that size
(pp, dp, a tp that is a multiple of the saver's) and names the others.

Sources are saved by megatron-core (the GQA model: vocab 100, make_vocab_size_divisible_by=16)
with ``--args-vocab off``: the args the worker writes say ``GPT2BPETokenizer`` and no vocab_size.
"""

import json

import pytest
import torch

from inprocess_cli import tenplex
from mcore_helpers import MODELS, logits, run_worker

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

FLAGS = MODELS["gqa"].replace("--dist-args off", "") + " --args-vocab off"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """``{tp: folder}``: saved at tp 1 (112 rows) and tp 2 (128 rows), both formats, with logits."""
    out = {}
    for tp in (1, 2):
        d = tmp_path_factory.mktemp(f"tp{tp}")
        run_worker(tp, 1, FLAGS, "--save", "both", "--save-dir", str(d), "--logits-out", str(d / "ref.pt"))
        out[tp] = d
    return out


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_a_config_whose_padding_is_certain_reshards_and_loads(sources, tmp_path, fmt):
    """tp 1 -> tp 2, pp 2: every tokenizer size the args allow (97..112) pads to 128 at tp 2, the
    rows Megatron-LM at tp 2 makes; megatron-core loads the output with the source's logits."""
    src = sources[1]
    done = tenplex("reshard", str(src / fmt), str(tmp_path / "out"), "--to", "tp=2,pp=2")
    assert done.returncode == 0, done.stderr
    run_worker(2, 2, FLAGS, "--load", fmt, "--load-dir", str(tmp_path / "out"),
                     "--logits-out", str(tmp_path / "got.pt"))
    assert (logits(src / "ref.pt") - logits(tmp_path / "got.pt")).abs().max().item() <= 1e-6


def test_an_uncertain_padding_is_refused_until_the_size_is_given(sources, tmp_path):
    """tp 2 -> tp 1: 97..128 tokens pad to 112 or 128 rows at tp 1, depending on the size; the reshard
    is refused in one line that names both and writes nothing. Given the size, it reshards and loads."""
    src = sources[2]
    done = tenplex("reshard", str(src / "legacy"), str(tmp_path / "out"), "--to", "tp=1")
    assert done.returncode == 1
    assert "the tokenizer's 97..128 tokens pad to 112 to 128 rows at tp=1" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
    config = tmp_path / "vocab.json"
    config.write_text(json.dumps({"vocab_size": 100}))
    done = tenplex("--model-config", str(config), "reshard", str(src / "legacy"), str(tmp_path / "out"),
                   "--to", "tp=1")
    assert done.returncode == 0, done.stderr
    run_worker(1, 1, FLAGS, "--load", "legacy", "--load-dir", str(tmp_path / "out"),
               "--logits-out", str(tmp_path / "got.pt"))
    assert (logits(src / "ref.pt") - logits(tmp_path / "got.pt")).abs().max().item() <= 1e-6
    stored = torch.load(next((tmp_path / "out").glob("iter_*/mp_rank_00/model_optim_rng.pt")),
                        weights_only=False)["args"]
    assert (stored.vocab_size, stored.padded_vocab_size) == (None, 112)


def test_no_args_at_all_asks_for_the_model_config(tmp_path):
    """A torch_dist save without args (Megatron-Bridge keeps its config in the iteration folder's
    run_config.yaml instead) asks for --model-config, and names run_config.yaml where there is one."""
    src = tmp_path / "src"
    run_worker(1, 1, MODELS["gqa"], "--save", "dist", "--save-dir", str(src))
    done = tenplex("reshard", str(src), str(tmp_path / "out"), "--to", "tp=2")
    assert done.returncode == 1 and "no args in common.pt; pass the model config" in done.stderr, done.stderr
    assert "run_config.yaml" not in done.stderr
    (src / "run_config.yaml").write_text("model:\n  num_layers: 4\n")
    done = tenplex("reshard", str(src), str(tmp_path / "out"), "--to", "tp=2")
    assert "its run_config.yaml (Megatron-Bridge's config, which tenplex does not read)" in done.stderr
    assert not (tmp_path / "out").exists()
