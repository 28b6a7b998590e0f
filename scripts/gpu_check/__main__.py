"""`python -m gpu_check [driver options]`, or `python -m gpu_check section NAME --out DIR [--dry]`
(one section, as the driver runs it)."""

import sys

if len(sys.argv) > 1 and sys.argv[1] == "section":
    from gpu_check.sections import main as section_main

    sys.exit(section_main(sys.argv[2:]))
from gpu_check.driver import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
