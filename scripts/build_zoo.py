"""Build the zoo (model_cards/README.md, model_cards/zoo.json and one card per entry) from conversion outputs.

    python scripts/build_zoo.py runs/zoo/hybrid-w64-sink4-hedgehog runs/zoo/gdn ... --out model_cards

Each argument is an `hf-recattn convert` output folder whose run finished with evaluation. With ``--add`` the
entries already in the index stay (those the given runs do not rebuild) and the index names both commands.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from hf_recattn.zoo import build_zoo, format_zoo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="conversion output folders (report.json + model/)")
    parser.add_argument("--out", default="model_cards", help="where the cards and the index go")
    parser.add_argument("--add", action="store_true", help="keep the entries already in the index")
    args = parser.parse_args(argv)
    command = "python scripts/build_zoo.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    try:
        entries = build_zoo(args.runs, args.out, command, add=args.add)
    except ValueError as err:
        print(f"build_zoo: error: {err}", file=sys.stderr)
        return 2
    print(format_zoo(entries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
