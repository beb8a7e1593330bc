"""Sum a ``METAPS_TEST_CPU_LOG`` file (tests/conftest.py) per test module, most CPU first.

Run::

    METAPS_TEST_CPU_LOG=/tmp/cpu.jsonl make test
    python -m tests.cpu_report /tmp/cpu.jsonl [--top 40]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    with open(args.log) as f:
        for line in f:
            r = json.loads(line)
            m = per[r["nodeid"].split("::", 1)[0]]
            m[0] += r["wall"]
            m[1] += r["self"]
            m[2] += r["children"]
            m[3] += 1
    rows = sorted(per.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))
    total = sum(v[1] + v[2] for v in per.values())
    print(f"{'module':58s} {'tests':>5s} {'wall':>7s} {'cpu':>7s} {'self':>7s} {'kids':>7s}")
    for mod, (wall, me, kids, n) in rows[:args.top]:
        print(f"{mod:58s} {int(n):5d} {wall:7.1f} {me + kids:7.1f} {me:7.1f} {kids:7.1f}")
    print(f"total CPU {total:.0f} s over {len(per)} modules, {sum(int(v[3]) for v in per.values())} tests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
