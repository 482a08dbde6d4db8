"""The differential property across processes (issue 9): for random GPT trees, config pairs
``A -> B`` (world sizes up to 4), lost ranks and small checksum blocks, ``save_distributed``
then ``load``, and ``recover`` with a store fallback, both equal ``materialize(x, B, r)`` bit
for bit on every rank ``r`` of ``B``.

A pool of 4 gloo processes (started once) runs every example; see ``property_workers``.
Shrinking is off: an example that fails is printed as drawn.
"""

import multiprocessing as mp
import queue
import uuid

import pytest
from hypothesis import Phase, example, given, settings, strategies as st

from tenplex.models import gpt_tree

from tests.helpers import property_workers as pw
from tests.helpers.strategies import gpt_specs, valid_configs


pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
CTX = mp.get_context("spawn")


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    rendezvous = str(tmp_path_factory.mktemp("pool") / "rendezvous")
    inboxes = [CTX.Queue() for _ in range(4)]
    outbox = CTX.Queue()
    procs = [CTX.Process(target=pw.serve, args=(r, rendezvous, inboxes[r], outbox)) for r in range(4)]
    for p in procs:
        p.start()
    yield inboxes, outbox, procs
    for box in inboxes:
        box.put(None)
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()


@st.composite
def examples(draw):
    spec = draw(gpt_specs())
    tree = gpt_tree(spec)
    configs = valid_configs(tree, max_world=4)
    a, b = draw(st.sampled_from(configs)), draw(st.sampled_from(configs))
    lost = draw(st.sets(st.integers(0, a.world_size - 1), max_size=a.world_size))
    block = draw(st.sampled_from([64, 200, 1024, 4096]))
    return {"spec": dict(spec.__dict__), "a": str(a), "b": str(b), "lost": sorted(lost),
            "block": block, "seed": draw(st.integers(0, 1000))}


# found by this test: a process reading from the store cut its streams' chunks from half its
# budget while its peers used their whole one (8192 vs 4096 bytes: gloo aborts both processes)
REGRESSION = {"spec": {"num_layers": 4, "hidden": 8, "heads": 8, "query_groups": 1, "ffn": 24,
                       "vocab": 11, "seq_len": 6, "swiglu": True, "tied": False, "rope": False,
                       "bias": True, "layernorm": False, "dtype": "float32",
                       "make_vocab_size_divisible_by": 8, "optimizer": "distributed_adam",
                       "bucket_numel": 40},
              "a": "dp=2,tp=1,pp=2,stages=1:3", "b": "dp=3,tp=1,pp=1", "lost": [2], "block": 1024,
              "seed": 49}


@settings(max_examples=25, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(example=examples())
@example(example=REGRESSION)
def test_save_distributed_load_and_recover_equal_materialize(pool, tmp_path_factory, example):
    inboxes, outbox, procs = pool
    assert all(p.is_alive() for p in procs), "a pool worker died"
    example = {**example, "url": f"file://{tmp_path_factory.mktemp('ck')}/{uuid.uuid4().hex}"}
    for box in inboxes:
        box.put(example)
    results = {}
    for _ in range(4):
        try:
            rank, problems = outbox.get(timeout=300)
        except queue.Empty:
            pytest.fail(f"the pool did not finish the example in 300 s: {example}")
        results[rank] = problems
    assert all(not p for p in results.values()), (example, results)
