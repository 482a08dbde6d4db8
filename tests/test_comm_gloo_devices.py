"""A gloo group of several devices per process: large messages travel in parts, one per device,
and arrive whole (tenplex.transform.comm.TorchComm; bench/gloo_channels.py for the speed)."""

import json
import multiprocessing as mp

import pytest

from tests.helpers import gloo_parts_workers as w

pytestmark = pytest.mark.multiprocess
CTX = mp.get_context("spawn")


def test_messages_travel_in_one_part_per_gloo_device_and_arrive_bit_for_bit(tmp_path):
    procs = [CTX.Process(target=w.run, args=(r, str(tmp_path / "rdzv"), str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        if p.is_alive():
            p.kill()
            pytest.fail("a worker hung")
    errors = [e.read_text() for e in tmp_path.glob("error-*.txt")]
    assert [p.exitcode for p in procs] == [0, 0], errors
    for rank in range(2):
        r = json.loads((tmp_path / f"result-{rank}.json").read_text())
        # sends, then receives: the big message in two parts, the 100-byte one whole
        assert r["exchange"] == {"devices": 2, "cuts": [2, 1, 2, 1], "equal": True}, r
        assert r["live"]["equal"] and r["live"]["sent"] > 0, r
        assert r["live"]["cuts"] == 2, r  # the live change cut its messages too



def test_abort_closes_the_connections_of_every_gloo_device(tmp_path):
    procs = [CTX.Process(target=w.abort_run, args=(r, str(tmp_path / "rdzv"), str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
            pytest.fail("a worker hung")
    assert not list(tmp_path.glob("error-*.txt")), [e.read_text() for e in tmp_path.glob("error-*.txt")]
    r = json.loads((tmp_path / "result-0.json").read_text())
    assert r["devices"] == 2, r
    assert max(r["seconds"]) < 4, r  # process 1 lives on for 6 s after its abort
