"""Write tests/slow.txt, the tests the developer's inner loop leaves out, from a timed run of the suite.

    ./dev.sh test --durations=0 -p no:randomly > durations.log
    python tools/slow_tests.py durations.log --over 1.5 > tests/slow.txt

A test is slow when its setup, call and teardown together took over ``--over`` seconds in
that run. tests/conftest.py marks the listed tests ``slow``; ``./dev.sh test -m "not slow"``
runs the rest (under 3 minutes on the 2-core machines here), CI runs everything.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import platform
import re
import sys

LINE = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(\S+)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", help="the output of a pytest run with --durations=0")
    parser.add_argument("--over", type=float, default=6.0, help="seconds above which a test is slow (default 6)")
    parser.add_argument("--note", default="", help="how the run was made (machine, load), for the header")
    args = parser.parse_args(argv)
    seconds: collections.Counter[str] = collections.Counter()
    with open(args.log) as f:
        for line in f:
            m = LINE.match(line)
            if m:
                seconds[m.group(3)] += float(m.group(1))
    if not seconds:
        print(f"{args.log} has no durations: run pytest with --durations=0", file=sys.stderr)
        return 2
    slow = sorted(((t, n) for n, t in seconds.items() if t > args.over), key=lambda x: (x[1].split("::")[0], -x[0]))
    fast = sum(t for t in seconds.values() if t <= args.over)
    print(f"# Tests marked slow (tests/conftest.py): over {args.over:g} s each in a timed run, "
          f"{datetime.date.today()}, {platform.machine()} {args.note}".rstrip())
    print(f"# {len(slow)} of the {len(seconds)} tests timed; the others took {fast:.0f} s of "
          f"{sum(seconds.values()):.0f} s. Regenerate with tools/slow_tests.py.")
    for t, node in slow:
        print(f"{t:7.1f}  {node}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
