"""Prints the config reference (Markdown) from the config dataclasses' field docs.

    python scripts/config_reference.py > /tmp/ref.md   # paste into README.md

tests/test_readme.py checks that README.md lists every field, so the two cannot drift.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.config import SECTIONS  # noqa: E402
from configuration.fields import field_docs  # noqa: E402
from configuration.environment import ENV_KNOBS  # noqa: E402


def reference() -> str:
    out = []
    for section, cls in SECTIONS.items():
        out.append(f"**[{section}]**\n")
        out.append("| key | type | default | meaning |")
        out.append("|---|---|---|---|")
        for name, tname, default, doc in field_docs(cls):
            if isinstance(default, str) and len(default) > 40:
                default = "…" + default[-30:]
            out.append(f"| `{name}` | {tname.replace(' | ', ' or ')} | `{default!r}` | {doc.replace('|', '/')} |")
        out.append("")
    out.append("**Environment variables** (diagnostics, launchers and test hooks; configuration belongs in TOML)\n")
    out.append("| variable | meaning |")
    out.append("|---|---|")
    out.extend(f"| `{name}` | {doc.replace('|', '/')} |" for name, doc in ENV_KNOBS.items())
    out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(reference())
