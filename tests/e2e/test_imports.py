"""What `import dataparallel` costs a fresh process ([Note: imported when used] in
strategies/parts/tensor_parallel.py): the heavy modules it does not import until used."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = (
    "torch.distributed.tensor",  # 1.3-1.8 s: imported where a DTensor is made or read
    "torch.distributed.checkpoint",  # the checkpoint writer's
    "transformers",  # an hf: model's
    "matplotlib",  # the run's report
    "torch.utils.tensorboard",  # the run's writer
    "lightning",  # the Lightning strategy's
)


def test_import_dataparallel_leaves_the_heavy_modules_unimported():
    code = (
        "import json, sys; import dataparallel as dp; "
        f"print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]), "
        "dp.parallelize.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, name = out.stdout.split()
    assert json.loads(loaded) == [] and name == "parallelize", out.stdout
