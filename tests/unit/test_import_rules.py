"""The layering rule: `store/` and the core modules never import vLLM or torch."""

from __future__ import annotations

import subprocess
import sys


def test_store_and_core_import_without_vllm_or_torch():
    code = (
        "import sys\n"
        "import kvpool, kvpool.config, kvpool.errors, kvpool.keys, kvpool.store\n"
        "bad = [m for m in ('vllm', 'torch') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
