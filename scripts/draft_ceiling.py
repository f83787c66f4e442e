"""Ceilings of the decoding phase's speedup over vanilla, per workload: ``leapdecode bench --ceiling``
(``src/leapdecode/bench/ceiling.py`` says what each ceiling is), kept under this name with its own
default of 192 new tokens; every option is the bench's (-m, --workload, --categories, --limit, --seed,
--json-object, --max-new-tokens, --memory, --replay, --outputs, --save, and the model flags).

    python scripts/draft_ceiling.py --limit 8 --max-new-tokens 128 --save bench_out/ceil-dev.json
"""

from __future__ import annotations

import sys

from leapdecode.cli import main

MAX_NEW_TOKENS = 192  # this script's default (the bench's is 256); a --max-new-tokens given wins

if __name__ == "__main__":
    sys.exit(main(["bench", "--ceiling", "--max-new-tokens", str(MAX_NEW_TOKENS), *sys.argv[1:]]))
