"""A gloo group of several devices per process: large messages travel in parts, one per device,
and arrive whole; an abort closes every device's connections (tenplex.transform.comm.TorchComm;
bench/gloo_channels.py for the speed)."""

import json
import multiprocessing as mp

import pytest

from tests.helpers import gloo_parts_workers as w

pytestmark = pytest.mark.multiprocess
CTX = mp.get_context("spawn")


def _run_pair(target, tmp_path) -> list[dict]:
    """Run ``target(rank, rendezvous, out_dir)`` in two processes; the results they wrote."""
    procs = [CTX.Process(target=target, args=(r, str(tmp_path / "rdzv"), str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        if p.is_alive():
            p.kill()
            pytest.fail("a worker hung")
    errors = [e.read_text() for e in tmp_path.glob("error-*.txt")]
    assert not errors and [p.exitcode for p in procs] == [0, 0], errors
    return [json.loads(f.read_text()) for f in sorted(tmp_path.glob("result-*.json"))]


def test_messages_travel_in_one_part_per_gloo_device_and_arrive_bit_for_bit(tmp_path):
    for r in _run_pair(w.run, tmp_path):
        # sends, then receives: the big message in two parts, the 100-byte one whole
        assert r["exchange"] == {"devices": 2, "cuts": [2, 1, 2, 1], "equal": True}, r
        assert r["live"]["equal"] and r["live"]["sent"] > 0, r
        assert r["live"]["cuts"] == 2, r  # the live change cut its messages too


def test_abort_closes_the_connections_of_every_gloo_device(tmp_path):
    [r] = _run_pair(w.abort_run, tmp_path)  # process 0's
    assert r["devices"] == 2, r
    assert max(r["seconds"]) < 4, r  # process 1 lives on for 6 s after its abort
