"""A shortened `tenplex demo` (tiny model, two steps per phase) as CI runs it."""

import json
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


def test_short_demo_matches_the_static_run(tmp_path):
    out = tmp_path / "demo"
    done = tenplex("demo", "--model", "tiny", "--steps", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["samples_match"] is True                 # no sample skipped or repeated
    assert last["max_loss_diff"] <= 1e-3                  # the bound
    assert last["within_spread"] is True                  # inside the static runs' rounding noise
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and (out / "loss.png").stat().st_size > 10_000
    changes = [row["change"] for row in summary["phases"]]
    assert "live" in changes and any(c.startswith("restart") for c in changes)
    live = next(r for r in summary["phases"] if r["change"] == "live")
    assert live["moved"] == live["lower_bound"] > 0
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
