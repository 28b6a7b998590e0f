"""README.md stays true: its config reference is the one the code generates."""

import re
import subprocess
import sys

from tests.helpers import REPO


def test_readme_config_reference_is_current():
    generated = subprocess.run([sys.executable, "scripts/config_reference.py"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout.strip()
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- config-reference:start -->\n(.*)\n<!-- config-reference:end -->", readme, re.S)
    assert block, "README.md lost its config-reference markers"
    assert block.group(1).strip() == generated, "run: python scripts/config_reference.py and paste into README.md"


def test_readme_gives_the_two_commands():
    readme = (REPO / "README.md").read_text()
    assert "./run_train.sh" in readme and "python -m pytest -q" in readme
    ci = (REPO / ".ci" / "run").read_text()
    assert "python -m pytest -q" in ci
