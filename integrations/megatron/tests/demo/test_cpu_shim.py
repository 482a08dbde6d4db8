"""``cpu_shim.apply()`` before megatron-core's first import keeps torch.compile's machinery out.

megatron-core decorates its fused kernels with ``torch.compile`` at import
(``megatron/core/jit.py``); with the fusions off on CPU they never run, but the
decorators imported ``torch._dynamo`` and ``torch._inductor`` in every demo and
test worker (2.6 of the 4.6 s megatron-core's import took).
"""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

PROBE = """
import sys
from tenplex_megatron import cpu_shim
cpu_shim.apply_optimizer_patches()
import megatron.core.models.gpt, megatron.core.optimizer, megatron.core.distributed
print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""


def test_megatron_core_imports_without_dynamo_or_inductor():
    """A fresh process: after ``apply_optimizer_patches()``, megatron-core's model, optimizer and DDP
    import neither (on the code before the shim's change both were imported)."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
