"""The tenplex CLI: round trips through it, output, exit codes."""

import json
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex.api import load_global, save
from tenplex.cli.main import main
from tenplex.models import random_state
from tenplex.ptree import materialize
from tenplex.ptree.shards import bitwise_equal

from tests.helpers.strategies import tree_and_configs


@given(tree_and_configs(), st.integers(0, 2**31))
@settings(max_examples=25)
def test_reshard_round_trip_through_the_cli(tmp_path_factory, args, seed):
    spec, tree, a, b = args
    tmp = tmp_path_factory.mktemp("cli")
    state = random_state(tree, a, seed % 1000)
    save(str(tmp / "src"), tree, a, {r: materialize(tree, state, a, r) for r in range(a.world_size)})
    assert main(["reshard", str(tmp / "src"), str(tmp / "dst"), "--to", str(b)]) == 0
    before, after = load_global(str(tmp / "src")), load_global(str(tmp / "dst"))
    for path, _ in tree.tensors():
        assert bitwise_equal(before[path], after[path]), path
    assert main(["verify", str(tmp / "dst")]) == 0


def test_commands_and_output(tmp_path, capsys):
    src, dst = tmp_path / "a", tmp_path / "b"
    assert main(["example", str(src), "--layers", "2", "--hidden", "64", "--config", "dp=2,tp=2,pp=1"]) == 0
    assert main(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    assert "config dp=2,tp=2,pp=1" in out and "model/layers/1/mlp/fc2/weight" in out and "S(1" in out
    assert main(["inspect", str(src), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["config"]["tp"] == 2 and info["logical_bytes"] > 0
    assert main(["plan", str(src), "--to", "dp=1,tp=1,pp=2,stages=1:1"]) == 0
    out = capsys.readouterr().out
    assert "lower bound" in out and "src 0" in out and "dst 1" in out
    assert main(["plan", str(src), "--to", "dp=1,tp=4,pp=1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["needed"] == plan["local"] + plan["host"] + plan["network"]
    assert 0 < plan["placement_bound"] <= plan["lower_bound"] <= plan["moved"]
    assert main(["reshard", str(src), str(dst), "--to", "dp=1,tp=1,pp=2,stages=1:1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bytes_written"] > 0 and report["bytes_read"] >= report["bytes_needed"]
    assert main(["verify", str(dst)]) == 0
    assert "every checksum verified" in capsys.readouterr().out


def test_errors_exit_1_with_one_line(tmp_path, capsys):
    src = tmp_path / "a"
    main(["example", str(src), "--layers", "2", "--hidden", "64"])
    capsys.readouterr()
    assert main(["plan", str(src), "--to", "tp=3"]) == 1
    err = capsys.readouterr().err
    assert err == "tenplex plan: tp=3 does not divide num_query_groups=8 (model/layers/0/attention/qkv/weight)\n"
    assert main(["reshard", str(src), str(src), "--to", "tp=1"]) == 1
    assert "a committed checkpoint exists" in capsys.readouterr().err
    (tmp_path / "file").write_bytes(b"kept")  # a file where the checkpoint should go: named, kept
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "shards").write_bytes(b"kept")
    for dst in ("file", "dir/shards"):
        assert main(["reshard", str(src), str(tmp_path / dst.split("/")[0]), "--to", "tp=1"]) == 1
        assert capsys.readouterr().err == (f"tenplex reshard: {tmp_path / dst}: expected a directory or a new "
                                           "path, found a file; save to a new location\n")
        assert (tmp_path / dst).read_bytes() == b"kept"
    assert sorted(p.name for p in (tmp_path / "dir").iterdir()) == ["shards"]
    with pytest.raises(SystemExit) as usage:  # an unset $TO is not one rank
        main(["reshard", str(src), str(tmp_path / "x"), "--to", ""])
    assert usage.value.code == 2 and "expected at least one degree" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert main(["inspect", str(tmp_path / "nothing")]) == 1
    assert "not a checkpoint of any known format" in capsys.readouterr().err
    assert main(["--debug", "inspect", str(tmp_path / "nothing")]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_usage_errors_exit_2_from_the_console_script(tmp_path):
    run = lambda *a: subprocess.run(["tenplex", *a], capture_output=True, text=True)
    assert run("plan", str(tmp_path), "--to", "tp=x").returncode == 2
    assert run("bogus").returncode == 2
    done = run("inspect", str(tmp_path / "missing"))
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1


def test_a_closed_output_pipe_ends_quietly(tmp_path):
    """``tenplex inspect X | head -1``: the reader goes away; no 'BrokenPipeError' line, exit 1 (Python's
    "Note on SIGPIPE"). The pipe's reading end is closed before the command writes, so every run sees it."""
    import os

    assert main(["example", str(tmp_path / "ex"), "--layers", "2", "--hidden", "64", "--heads", "4"]) == 0
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(["tenplex", "inspect", str(tmp_path / "ex")], stdout=write, stderr=subprocess.PIPE,
                              text=True)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (1, "")


class _Writes:
    """A stderr that records each write call (as an unbuffered stream passes them on)."""

    def __init__(self):
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_the_error_line_reaches_stderr_in_one_write(tmp_path, monkeypatch):
    """Under torchrun every process writes its error line to one pipe; with unbuffered stderr
    (PYTHONUNBUFFERED) a line written in two pieces (text, then newline) could be split by another
    process's line, and two lines would run together."""
    writes = _Writes()
    monkeypatch.setattr("sys.stderr", writes)
    assert main(["inspect", str(tmp_path / "nothing")]) == 1
    assert len(writes.calls) == 1 and writes.calls[0].endswith("\n"), writes.calls
    assert writes.calls[0].startswith("tenplex inspect: ") and writes.calls[0].count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["plan", "SRC", "--to", "tp=1", "--per-host", "0"], "--per-host: expected an integer >= 1, found '0'"),
    (["reshard", "SRC", "DST", "--to", "tp=1", "--threads", "-3"], "--threads: expected an integer >= 1"),
    (["reshard", "SRC", "DST", "--to", "tp=1", "--timeout", "nan"], "--timeout: expected a finite number"),
    (["reshard", "SRC", "DST", "--to", "tp=-1"], "tp: expected an integer from 1 to 65536, found '-1'"),
    (["verify", "SRC", "--threads", "0"], "--threads: expected an integer >= 1"),
    (["example", "DST", "--layers", "0"], "--layers: expected an integer >= 1"),
    (["demo", "--steps", "0"], "--steps: expected an integer >= 1"),  # ran 25 s and reported 0 steps
    (["demo", "--micro-batch", "0"], "--micro-batch: expected an integer >= 1"),  # ZeroDivisionError
])
def test_counts_below_one_are_usage_errors(argv, message, capsys, tmp_path, monkeypatch):
    """Before, ``--per-host 0`` ended in a ZeroDivisionError, ``--threads 0`` was taken as 1, and the
    demo ran its workers before failing on a batch or sequence of 0."""
    monkeypatch.chdir(tmp_path)  # where a command that parses wrongly would write
    with pytest.raises(SystemExit) as usage:
        main(argv)
    assert usage.value.code == 2 and message in capsys.readouterr().err
