"""``python -m minivllm.exercises status``: which parts of your engine are written and pass their checks."""

import argparse
import os
import sys
from pathlib import Path

from minivllm.exercises.progress import status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minivllm.exercises", description=__doc__.split(":")[1].strip())
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="every part: written or not, and its check (exit 0 only when all pass)")
    st.add_argument("folder", nargs="?", default=".", type=Path,
                    help="the folder of the exercise notebooks, which holds your_engine/ (default: here)")
    st.add_argument("--chapters", nargs="+", metavar="NN", help="only these chapters' parts, e.g. --chapters 04 05")
    st.add_argument("--no-checks", action="store_true", help="only say which parts are written (seconds)")
    runs = st.add_mutually_exclusive_group()
    runs.add_argument("--live", action="store_true",
                      help="also run each check's live engine after its targeted cases (minutes a part)")
    runs.add_argument("--no-live", dest="live", action="store_false",
                      help="only each check's targeted cases, stopping at the first failure (the default: seconds)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the checks' embedded model is on disk
    ok = status(args.folder / "your_engine", args.chapters, not args.no_checks, live=args.live)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
