"""``import lightning_moe`` loads none of the optional accelerators (they are imported lazily, where used).

Fake packages that record their own import stand in for the accelerators, so the test fails if
any module imports one eagerly, whether or not the real package is installed here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

OPTIONAL = ("triton", "transformer_engine", "deep_ep", "grouped_gemm", "liger_kernel", "megatron")


def test_import_loads_no_optional_accelerator(tmp_path: Path) -> None:
    for name in OPTIONAL:
        pkg = tmp_path / name
        pkg.mkdir()
        (pkg / "__init__.py").write_text(f"raise ImportError('{name} was imported eagerly')\n")
    code = (
        "import json, sys\n"
        "import lightning_moe, lightning_moe.moe, lightning_moe.ops, lightning_moe.callbacks\n"
        "import lightning_moe.strategies, lightning_moe.parallel, lightning_moe.models\n"
        f"print(json.dumps([m for m in {list(OPTIONAL)!r} if m in sys.modules]))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
