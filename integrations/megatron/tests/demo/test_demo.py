"""`tenplex demo` as the README runs it, a shortened bf16 one, its schedule checks, and its worker errors."""

import json
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def tenplex(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "tenplex.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_readme_default_demo(tmp_path):
    """`tenplex demo` exactly as the README runs it: default model, schedule and output."""
    exe = shutil.which("tenplex")
    assert exe, "the `tenplex` console script is not installed"
    done = subprocess.run([exe, "demo"], cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["samples_match"] is True
    assert last["max_loss_diff"] <= 1e-3
    assert (tmp_path / "tenplex-demo" / "summary.json").exists()


def test_short_bf16_demo_moves_live_at_the_lower_bound(tmp_path):
    """bf16 params (fp32 main params): every change is live, moves exactly the planner's lower
    bound, and keeps the sample order. (In bf16 the static runs themselves drift apart by far
    more than 1e-3, so the loss bound is checked on the fp32 default above.)"""
    out = tmp_path / "demo"
    done = tenplex("demo", "--model", "tiny", "--steps", "2", "--dtype", "bf16", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["samples_match"] is True                 # no sample skipped or repeated
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["dtype"] == "bf16" and (out / "loss.png").stat().st_size > 10_000
    changes = summary["phases"][1:]
    assert [row["change"] for row in changes] == ["live"] * 3
    assert all(row["moved"] == row["lower_bound"] > 0 for row in changes), changes
    assert all(0 <= row["placement_bound"] <= row["moved"] for row in changes), changes
    assert {1, 2} <= _steps(summary["bit_exact_steps"])  # phase 1 is the static run's own config


def _steps(ranges: str) -> set[int]:
    """``"1-5, 7-8"`` as ``{1, 2, 3, 4, 5, 7, 8}``."""
    out = set()
    for item in filter(None, (part.strip() for part in ranges.split(","))):
        first, _, last = item.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


@pytest.mark.parametrize("schedule,message", [
    ("dp=1,tp=3,pp=1:2", "tp=3 does not divide num_attention_heads=4"),
    ("dp=8,tp=1,pp=1:2", "needs 8 workers; this machine holds at most"),
    ("dp=1,tp=1,pp=3:2", "pp=3 does not divide num_layers=2"),
    ("dp=3,tp=1,pp=1:2", "dp=3 does not divide the global batch 8"),
    ("dp=1,tp=1,pp=1", "expected 'dp=D,tp=T,pp=P:STEPS'"),
])
def test_bad_schedules_are_refused_before_anything_runs(tmp_path, schedule, message):
    out = tmp_path / "demo"
    done = tenplex("demo", "--model", "tiny", "--schedule", schedule, "--out", str(out),
                   "--max-workers", "4", timeout=120)
    assert done.returncode == 1
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not out.exists()


def _raise_in_worker_1(process, port, queue):
    from tenplex_megatron.demo.workers import report_error
    try:
        if process == 1:
            raise ValueError("shape mismatch\nshape '[384, 128]' is invalid for input of size 43122")
        queue.put(("done", process))
    except BaseException as exc:
        report_error(queue, process, exc, "run elastic, phase 2")


def _kill_worker_1(process, port, queue):
    import os
    import signal
    if process == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    queue.put(("done", process))


def test_a_failed_worker_is_named_with_its_exception_and_last_line():
    from tenplex_megatron.demo.workers import WorkerError, run_workers
    with pytest.raises(WorkerError) as info:
        run_workers("demo", 2, _raise_in_worker_1, (), print, timeout=60)
    assert str(info.value) == ("demo run elastic, phase 2: worker 1 failed: ValueError: shape '[384, 128]' is "
                               "invalid for input of size 43122")
    assert "Traceback" in info.value.worker_traceback and "_raise_in_worker_1" in info.value.worker_traceback


def test_a_killed_worker_is_named_with_its_signal():
    from tenplex_megatron.demo.workers import WorkerError, run_workers
    with pytest.raises(WorkerError, match=r"^demo: worker 1 failed: killed by SIGKILL$"):
        run_workers("demo", 2, _kill_worker_1, (), print, timeout=60)


def test_cli_prints_one_line_and_debug_adds_the_worker_traceback(monkeypatch, capsys):
    from tenplex.cli import main as cli
    from tenplex_megatron.commands import DEMO
    from tenplex_megatron.demo.workers import WorkerError

    def fail(args):
        raise WorkerError("demo run elastic", 1, "RuntimeError: shape '[384, 128]' is invalid",
                          'Traceback (most recent call last):\n  File "reader.py", line 132, in read\n'
                          "RuntimeError: shape '[384, 128]' is invalid")
    monkeypatch.setattr(DEMO, "run", fail)  # the plugin the CLI finds by entry point
    assert cli.main(["demo"]) == 1
    err = capsys.readouterr().err
    assert err == ("tenplex demo: demo run elastic: worker 1 failed: RuntimeError: shape '[384, 128]' "
                   "is invalid\n")
    assert cli.main(["--debug", "demo"]) == 1
    err = capsys.readouterr().err
    assert 'File "reader.py", line 132, in read' in err and "worker 1's traceback" in err
    assert err.rstrip().splitlines()[-1].startswith("tenplex demo: demo run elastic: worker 1 failed")


def test_a_demo_worker_failure_reaches_the_cli_with_its_cause(tmp_path):
    """A real worker failure (torch's Adam refuses the learning rate inside every worker)."""
    out = tmp_path / "demo"
    done = tenplex("demo", "--model", "tiny", "--steps", "1", "--lr", "-1", "--out", str(out), timeout=300)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(r"tenplex demo: demo run elastic, phase 1: worker \d failed: "
                                            r"ValueError: Invalid learning rate: -1\.0", lines[0]), done.stderr
    assert not out.exists()
    debug = tenplex("--debug", "demo", "--model", "tiny", "--steps", "1", "--lr", "-1", "--out", str(out),
                    timeout=300)
    assert debug.returncode == 1 and "'s traceback:" in debug.stderr and "optim/adam.py" in debug.stderr
