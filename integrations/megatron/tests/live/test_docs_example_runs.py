"""docs/megatron.md's live lines are the ones that run: the example under torchrun, the recovery test."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[4]
BLOCK = re.compile(r"<!-- tested: (\S+)[^>]*-->\n```python\n(.*?)```", flags=re.S)


def _code(line: str) -> str:
    return re.sub(r"\s+#[^\"']*$", "", line).strip()


def _blocks():
    text = (ROOT / "docs" / "megatron.md").read_text()
    section = text[text.index("## Elastic training of a running job"):]
    return BLOCK.findall(section)


def test_every_live_line_in_the_docs_is_run_by_the_file_it_names():
    blocks = _blocks()
    assert [path for path, _ in blocks] == ["examples/megatron_elastic.py",
                                            "integrations/megatron/tests/live_survivors.py",
                                            "integrations/megatron/tests/live_snapshots.py"]
    for path, block in blocks:
        ran = {_code(line) for line in (ROOT / path).read_text().splitlines()}
        lines = [_code(line) for line in block.splitlines() if _code(line) and not line.lstrip().startswith("#")]
        assert len(lines) >= 6
        missing = [line for line in lines if line not in ran]
        assert not missing, (path, missing)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_megatron_elastic_example_runs_under_torchrun():
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                           str(ROOT / "examples" / "megatron_elastic.py")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(last) == {"max_loss_diff", "samples_match", "reconfig_s", "moved_over_lower_bound",
                         "moved_over_placement_bound"}
    assert last["samples_match"] is True
    assert last["moved_over_lower_bound"] == 1.0
    assert last["moved_over_placement_bound"] >= 1.0  # no numbering moves less than the bound
    assert 0 < last["reconfig_s"]
    assert last["max_loss_diff"] <= 1e-5      # fp32: reduction-order rounding only (measured 2.4e-7)
    assert done.stdout.count("moved ") == 3
