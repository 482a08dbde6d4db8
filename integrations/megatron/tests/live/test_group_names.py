"""Membership names every group the same on every process, whoever joined when (issue 24, defect 1).

Three processes form groups; one dies; a replacement meets the survivors in a
named group; then the world grows to four with a newcomer that never formed a
group, and shrinks and grows again. On e4220c6 the per-process counter made
the replacement and the newcomer form groups under other names than the
survivors, and the first grow timed out.
"""

import datetime
import json
import multiprocessing as mp
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
CTX = mp.get_context("spawn")
TIMEOUT = datetime.timedelta(seconds=20)


def _membership(process: int, port: int):
    from tenplex_megatron.live.group import Membership
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    return Membership(store, process, timeout=TIMEOUT)


def _check(m, size: int, out: str, tag: str) -> None:
    """The group is the world ``0 .. size-1``: an all-reduce of the ranks gives their sum."""
    x = torch.tensor([float(m.process)])
    dist.all_reduce(x)
    assert dist.get_world_size() == size and x.item() == sum(range(size)), (tag, x.item())
    with open(os.path.join(out, f"{tag}-{m.process}"), "w") as f:
        f.write(json.dumps(m.generation))


def _after_recovery(m, out: str) -> None:
    """Every process from the recovery on: grow with a newcomer, shrink, grow again."""
    for size in (4, 2, 4):
        if m.form(size):
            _check(m, size, out, f"size{size}-{m.generation}")
    m.leave()


def _original(process: int, port: int, out: str) -> None:
    m = _membership(process, port)
    for size in (3, 2, 3):
        if m.form(size):
            _check(m, size, out, f"before-{m.generation}")
    if process == 2:
        os._exit(0)                      # this process dies; a replacement takes its number
    m.leave()
    assert m.form(3, name="recovery-1")
    _check(m, 3, out, "recovery")
    _after_recovery(m, out)


def _replacement(process: int, port: int, out: str) -> None:
    m = _membership(process, port)
    assert m.form(3, name="recovery-1")
    _check(m, 3, out, "recovery")
    _after_recovery(m, out)


def _newcomer(process: int, port: int, out: str) -> None:
    m = _membership(process, port)      # never formed a group: follows process 0's announcements
    _after_recovery(m, out)


def _join(procs, deadline):
    for p in procs:
        p.join(max(1, deadline - time.time()))
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def test_replacement_and_newcomer_form_the_same_groups_as_survivors(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    out = str(tmp_path)
    first = [CTX.Process(target=_original, args=(p, port, out)) for p in range(3)]
    for p in first:
        p.start()
    first[2].join(60)
    assert first[2].exitcode == 0
    later = [CTX.Process(target=_replacement, args=(2, port, out)), CTX.Process(target=_newcomer, args=(3, port, out))]
    for p in later:
        p.start()
    codes = _join(first[:2] + later, time.time() + 120)
    assert codes == [0, 0, 0, 0]
    done = sorted(os.listdir(out))
    # every group of the grow-shrink-grow sequence was formed by all its members, under one generation
    for size, members in ((4, 4), (2, 2), (4, 4)):
        names = [n for n in done if n.startswith(f"size{size}-")]
        assert len(names) >= members
    gens = {n.rsplit("-", 1)[0] for n in done if n.startswith("size")}
    assert len(gens) == 3, gens     # three groups, each one name (generation) on every process
    del store
