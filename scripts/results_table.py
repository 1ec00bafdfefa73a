"""Rewrite the result table of README.md and docs/index.md from the studies' reports (`studies/*/report.json`):
each study's rows between the markers, the typed rows (the seed's published counts) kept
(src/slmsql/studies/readme.py says how).

    python scripts/results_table.py            # rewrite the files where they differ
    python scripts/results_table.py --check    # write nothing; exit 1 naming the files that differ

Run it after `slmsql study report` changes a report.json; tests/test_study_report.py fails until you do.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slmsql.errors import SlmsqlError
from slmsql.studies import readme


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]),
                        help="the repository (default: this script's)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs")
    args = parser.parse_args(argv)
    try:
        changed = readme.update(args.root, check=args.check)
    except SlmsqlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name in changed:
        print(f"{name}: {'differs from studies/*/report.json' if args.check else 'rewritten'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
