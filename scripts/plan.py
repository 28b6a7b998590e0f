#!/usr/bin/env python
"""Which layout fits, how fast it will run, and the TOML to run it (planner/, docs/planner.md).

  python scripts/plan.py --config llama8b.toml --gpus 8 --gpu h100-sxm --seq-len 8192 --global-batch-tokens 131072
  python scripts/plan.py --help
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
