"""``reconfigure(..., out=)``: the new state received in place into the caller's tensors.

Four gloo processes change dp=2,tp=2 -> dp=1,tp=4 (tests/helpers/out_workers.py). The result is
bit for bit the fresh-tensor path's and ``materialize``'s, in the very tensors given; an ``out``
with a wrong dtype, shape, device, a missing leaf or memory shared with the old state, or
``out=`` with renumbering, raises the same error on every process before anything moves.
"""

import multiprocessing as mp

import pytest

from tests.helpers import out_workers as w
from tests.helpers.rendezvous import free_port
from tests.test_elastic_multiprocess import _errors, _read, _run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
CTX = mp.get_context("spawn")

EXPECTED = {  # scenario -> (error type, words the message must hold)
    "dtype": ("ShardError", ["process 2", w.WRONG, "expected dtype float32", "found float64"]),
    "shape": ("ShardError", ["process 1", w.WRONG, "expected local shape", "found [1024]", "local state or out= does not match the tree"]),
    "device": ("ShardError", ["process 3", w.WRONG, "expected device cpu", "found meta"]),
    "missing": ("ShardError", ["process 0", w.WRONG, "missing"]),
    "shares_old": ("ShardError", ["process 2", w.WRONG, "shares memory with the old local state"]),
    "renumbered": ("PlanError", ["processes [0, 1, 2, 3] passed out=", "renumber=False"]),
}


def test_out_receives_in_place_and_bad_out_fails_everywhere_before_anything_moves(tmp_path):
    port = free_port()
    codes = _run([CTX.Process(target=w.run, args=(r, port, str(tmp_path))) for r in range(4)])
    assert codes == [0, 0, 0, 0], _errors(tmp_path)
    got = [_read(tmp_path, f"out-{r}") for r in range(4)]
    for r in range(4):
        assert got[r]["in_place"] == {"ok": True}, (r, got[r]["in_place"])
    for name, (kind, words) in EXPECTED.items():
        first = got[0][name]
        for r in range(4):  # the same error, with the same message, on every process
            assert got[r][name].get("error") == kind, (name, r, got[r][name])
            assert got[r][name]["message"] == first["message"], (name, r)
            assert got[r][name]["out_untouched"], (name, r)  # raised before anything moved
        for word in words:
            assert word in first["message"], (name, word, first["message"])
