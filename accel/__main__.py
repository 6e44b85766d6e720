"""Command line: ``python -m accel devices | bench NAME | bench --list | images``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    dev = sub.add_parser("devices", help="print the device report")
    dev.add_argument("--count", type=int, default=None,
                     help="also create this many logical devices with accel.devices.setup")
    bench = sub.add_parser("bench", help="run a benchmark; prints ratios against its baseline")
    bench.add_argument("name", nargs="?", help="benchmark name (see --list)")
    bench.add_argument("--list", action="store_true", help="list the benchmarks")
    img = sub.add_parser("images", help="regenerate the course figures")
    img.add_argument("names", nargs="*", help="only these figures, e.g. 06_scaling.png")
    img.add_argument("--out", default="images", help="output folder (default: images)")
    args = parser.parse_args(argv)

    if args.command == "devices":
        from accel import devices

        if args.count is not None:
            devices.setup(args.count)
        print(devices.report())
    elif args.command == "bench":
        from accel import bench as benchmarks

        if args.list or not args.name:
            for name, (_, text) in sorted(benchmarks.BENCHMARKS.items()):
                print(f"{name:12s} {text}")
            return 0
        try:
            benchmarks.run(args.name)
        except ValueError as exc:
            parser.error(str(exc))
    elif args.command == "images":
        from accel import viz

        try:
            paths = viz.save_figures(args.out, args.names or None)
        except ValueError as exc:
            parser.error(str(exc))
        for path in paths:
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
