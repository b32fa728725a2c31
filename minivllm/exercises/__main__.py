"""``python -m minivllm.exercises status``: which parts of your engine are written and pass their checks."""

import argparse
import os
import sys
from pathlib import Path

from minivllm.exercises.progress import CHAPTERS, status


def chapter(text: str) -> str:
    """A chapter as the exercises number it: ``4`` is ``04``."""
    return text.zfill(2) if text.isdigit() else text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minivllm.exercises", description=__doc__.split(":")[1].strip())
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="every part: written or not, and its check (exit 0 only when all pass)")
    st.add_argument("folder", nargs="?", default=".", type=Path,
                    help="the folder of the exercise notebooks, which holds your_engine/ (default: here)")
    st.add_argument("--chapters", nargs="+", metavar="NN", type=chapter, choices=CHAPTERS,
                    help=f"only these chapters' parts, e.g. --chapters 04 05 (among {', '.join(CHAPTERS)})")
    st.add_argument("--no-checks", action="store_true", help="only say which parts are written (seconds)")
    runs = st.add_mutually_exclusive_group()
    runs.add_argument("--live", action="store_true",
                      help="also run each check's live engine after its targeted cases (minutes a part)")
    runs.add_argument("--no-live", dest="live", action="store_false",
                      help="only each check's targeted cases, stopping at the first failure (the default: seconds)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        st.error(f"argument folder: {args.folder} is not a folder")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the checks' embedded model is on disk
    parts = args.folder / "your_engine"
    ok = status(parts, args.chapters, not args.no_checks, live=args.live)
    if not parts.is_dir() and not any(args.folder.glob("*.ipynb")):
        print(f"No your_engine/ and no exercise notebook in {args.folder.resolve()}: run this command in the "
              "folder of the exercise notebooks (exercises/ in the repository), or name that folder: "
              "python -m minivllm.exercises status path/to/exercises", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
