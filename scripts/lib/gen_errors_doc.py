"""Regenerate docs/errors.md from agent.errors.CODES: python scripts/lib/gen_errors_doc.py"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from agent.errors import CODES  # noqa: E402

HEAD = """# Error codes

Every failure a user or a fleet controller can cause is reported with one of these stable codes
(CLI: `error [code]: message` on stderr and exit status 2, or `{"error": {"code", "message"}}`
with `--json`; daemon: the job's `statusDetails.error_code`). The message says what was expected
and what was found. Codes are never renamed; new ones may be added.

| code | meaning |
|---|---|
"""

if __name__ == "__main__":
    rows = "".join("| `{}` | {} |\n".format(code, text) for code, text in CODES.items())
    with open(os.path.join(ROOT, "docs", "errors.md"), "w") as f:
        f.write(HEAD + rows)
