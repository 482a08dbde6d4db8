"""Issue 20: the verbs' own inputs under attack, and resource errors at the entries.

Every hostile argument to ``tenplex.save`` / ``load`` / ``reshard`` is refused
with a :class:`~tenplex.errors.TenplexError` naming the object, what was
expected and what was found, and nothing is left at the destination. A save
must never commit a checkpoint its own reader refuses (values and ``meta``
nested deeper, or holding longer integers, than the manifest parser reads).
A ``MemoryError`` or ``RecursionError`` anywhere under a verb or the
``tenplex`` command reaches the user as a :class:`~tenplex.errors.LimitError`
(one line, exit 1 from the CLI).

On 79514cb (checked by running this file with ``PYTHONPATH`` at an archive of
that commit): the deep and long-integer values and ``meta`` were committed and
then refused by ``load_global`` (``manifest.json: expected at most 68 levels of
nesting, found 203``) or escaped as ``TypeError``/``ValueError``; a ``str``
shard escaped as ``AttributeError: 'str' object has no attribute 'numel'``, a
meta-device tensor as ``TypeError: can't convert meta device type tensor to
numpy``; a cycle was refused with another message; 65532 missing ranks gave a 447 689-character message; ``rank="0"``
escaped as ``TypeError``, ``to=None`` as ``AttributeError``; a ``MemoryError``
reached the API as ``MemoryError`` and the CLI printed ``MemoryError: ...``.
"""

from __future__ import annotations

import functools
import pathlib
import tempfile

import pytest
import torch

import tenplex
from tenplex import ParallelConfig as P
from tenplex.cli.main import main
from tenplex.errors import ConfigError, LimitError, ShardError, TenplexError
from tenplex.models import GPTSpec, gpt_tree, random_state
from tenplex.ptree import materialize
from tenplex.store.reader import StoreReader

SPEC = GPTSpec(num_layers=1, hidden=16, heads=2, query_groups=2, ffn=32, vocab=40)
CFG = P(dp=2, tp=2)


@functools.cache
def _state():
    tree = gpt_tree(SPEC)
    state = random_state(tree, CFG, 1)
    return tree, {r: materialize(tree, state, CFG, r) for r in range(CFG.world_size)}


@functools.cache
def _good() -> str:
    tree, shards = _state()
    url = str(pathlib.Path(tempfile.mkdtemp(prefix="tenplex-verbs-")) / "good")
    tenplex.save(url, tree, CFG, shards)
    return url


def _deep(n: int) -> list:
    x: list = []
    for _ in range(n):
        x = [x]
    return x


def _with(change) -> dict:
    tree, shards = _state()
    out = {r: dict(s) for r, s in shards.items()}
    change(out, tree)
    return out


def _value(v):
    def change(out, tree):
        path = next(p for p, leaf in tree.values() if leaf.scope.value == "global")
        for r in out:
            out[r][path] = v
    return change


def _tensor(v):
    def change(out, tree):
        path = next(p for p, _ in tree.tensors())
        out[0][path] = v(out[0][path]) if callable(v) else v
    return change


class _Cycle(list):
    pass


def _cycle():
    a: list = []
    a.append(a)
    return a


SAVES = {  # id -> (shards change or None, meta, message)
    "value-nested-200": (_value(_deep(200)), None, r"value leaf scheduler/lr: expected at most 62 levels of nesting, found 201"),
    "value-nested-1e5": (_value(_deep(100_000)), None, r"value leaf scheduler/lr: expected at most 62 levels.*recursion limit"),
    "value-long-int": (_value(10 ** 60), None, r"value leaf scheduler/lr: expected integers of at most 40 digits, found one of 61"),
    "value-cycle": (_value(_cycle()), None, r"value leaf scheduler/lr: expected a JSON-serializable value.*Circular"),
    "meta-nested-200": (None, {"x": _deep(200)}, r"meta: expected at most 63 levels of nesting, found 202"),
    "meta-nested-1e5": (None, {"x": _deep(100_000)}, r"meta: expected at most 63 levels.*recursion limit"),
    "meta-long-int": (None, {"x": 10 ** 60}, r"meta: expected integers of at most 40 digits"),
    "meta-object": (None, {"x": object()}, r"meta: expected a JSON-serializable value.*object"),
    "shard-str": (_tensor("hello"), None, r"tensor model/embedding/word_embeddings/weight: expected a tensor with data.*'hello'"),
    "shard-meta-device": (_tensor(lambda t: torch.empty_like(t, device="meta")), None,
                          r"tensor model/embedding/word_embeddings/weight: expected a tensor with data"),
}


@pytest.mark.parametrize("case", SAVES, ids=list(SAVES))
def test_save_refuses_hostile_arguments_and_writes_nothing(case, tmp_path):
    change, meta, message = SAVES[case]
    tree, shards = _state()
    dst = tmp_path / "out"
    with pytest.raises(ShardError, match=message) as info:
        tenplex.save(str(dst), tree, CFG, _with(change) if change else shards, meta=meta)
    assert "\n" not in str(info.value) and len(str(info.value)) < 600
    assert not dst.exists(), f"a refused save left {sorted(p.name for p in dst.rglob('*'))}"


def test_a_value_at_the_depth_limit_is_saved_and_read_back(tmp_path):
    tree, _ = _state()
    dst = str(tmp_path / "ok")
    tenplex.save(dst, tree, CFG, _with(_value(_deep(61))), meta={"x": _deep(61)})
    assert tenplex.load_global(dst)["scheduler/lr"] == _deep(61)
    assert StoreReader(dst).manifest.meta["x"] == _deep(61)


def test_missing_ranks_of_a_huge_world_give_a_short_message(tmp_path):
    tree, shards = _state()
    with pytest.raises(ShardError, match=r"shards of 65532 ranks are missing: \[4, 5, 6") as info:
        tenplex.save(str(tmp_path / "out"), tree, P(dp=1 << 16), shards)
    assert len(str(info.value)) < 300
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("call,message", [
    (lambda url, dst: tenplex.load(url, rank="0"), r"rank: expected an int in \[0, 4\), found str '0'"),
    (lambda url, dst: tenplex.reshard(url, dst, None), r"to: expected a ParallelConfig, found None"),
    (lambda url, dst: tenplex.reshard(url, dst, "dp=1"), r"to: expected a ParallelConfig, found 'dp=1'"),
    # counts below 1, floats and bools were taken silently (threads=0 as 1, 2.5 as 2)
    (lambda url, dst: tenplex.load(url, threads=0), r"threads: expected an integer >= 1, found 0"),
    (lambda url, dst: tenplex.reshard(url, dst, P(dp=1, tp=2, pp=2), threads=2.5),
     r"threads: expected an integer >= 1, found 2.5"),
    (lambda url, dst: tenplex.reshard(url, dst, P(dp=1, tp=2, pp=2), max_open_files=0),
     r"max_open_files: expected an integer >= 1, found 0"),
    (lambda url, dst: tenplex.reshard(url, dst, P(dp=1, tp=2, pp=2), block=-1),
     r"block: expected an integer >= 1, found -1"),
    (lambda url, dst: tenplex.verify(url, threads=True), r"threads: expected an integer >= 1, found True"),
], ids=["load-rank-str", "reshard-to-none", "reshard-to-str", "load-threads-0", "reshard-threads-float",
        "reshard-max-open-files-0", "reshard-block-negative", "verify-threads-bool"])
def test_verbs_refuse_arguments_of_the_wrong_type(call, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        call(_good(), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", [MemoryError, RecursionError])
@pytest.mark.parametrize("verb", ["load", "load_global", "verify", "reshard"])
def test_resource_errors_under_a_verb_are_limit_errors(verb, kind, monkeypatch, tmp_path):
    url = _good()

    def exhausted(self, *args, **kwargs):
        raise kind("deep inside a reader")

    monkeypatch.setattr(StoreReader, "__init__", exhausted)
    call = {"load": lambda: tenplex.load(url), "load_global": lambda: tenplex.load_global(url),
            "verify": lambda: tenplex.verify(url, progress=False),
            "reshard": lambda: tenplex.reshard(url, str(tmp_path / "out"), P())}[verb]
    with pytest.raises(LimitError, match=rf"{verb}\({url}\): expected") as info:
        call()
    assert isinstance(info.value, TenplexError) and isinstance(info.value, MemoryError)
    assert info.value.__context__ is None and info.value.__cause__ is None
    assert not (tmp_path / "out").exists()


def test_resource_errors_under_save_are_limit_errors(monkeypatch, tmp_path):
    from tenplex.store import writer
    tree, shards = _state()

    def exhausted(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(writer, "gather_values", exhausted)
    with pytest.raises(LimitError, match=r"save\(.*out\): expected the input to fit in this process's memory"):
        tenplex.save(str(tmp_path / "out"), tree, CFG, shards)


@pytest.mark.parametrize("kind", [MemoryError, RecursionError])
@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_resource_errors_under_the_cli_are_one_line(command, kind, monkeypatch, capsys):
    url = _good()

    def exhausted(self, *args, **kwargs):
        raise kind("deep inside a reader")

    monkeypatch.setattr(StoreReader, "__init__", exhausted)
    assert main([command, url]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"tenplex {command}: {url}"), err
    assert "Error:" not in err[0] and "Traceback" not in err[0], err[0]
    assert ("recursion limit" if kind is RecursionError else "memory") in err[0]


def test_a_shards_link_out_of_the_destination_is_refused_and_nothing_written_there(tmp_path):
    # 79514cb followed dst/shards -> elsewhere and wrote the shard files outside the checkpoint
    from tenplex.errors import PathError

    tree, shards = _state()
    outside = tmp_path / "outside"
    outside.mkdir()
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "shards").symlink_to(outside)
    with pytest.raises(PathError, match=r"shards/rank-00000-.*outside the checkpoint"):
        tenplex.save(str(dst), tree, CFG, shards)
    assert list(outside.iterdir()) == []
    assert not (dst / "manifest.json").exists()
