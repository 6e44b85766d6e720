"""The course's command line.

  python -m accel devices [--count N]      the device report
  python -m accel bench --list             the benchmarks, one per line: name, tab, description
  python -m accel bench NAME [NAME ...]    run benchmarks (or 'all') in one process
  python -m accel images [NAME ...]        redraw the figures in images/
  python -m accel hardware-record [--backend B ...] [--out FILE] [--quick]
                                           measure what this machine's device reaches (matmul
                                           TFLOP/s per precision, memory and host-link GB/s)
                                           beside its data sheet; writes one JSON record (no
                                           TensorFlow: runs where only NumPy, CuPy or PyTorch is)
  python -m accel ceiling [--require X]    this machine's 2-thread ceiling now, and the CPU other
                                           processes used meanwhile; with --require, exit 1 if
                                           the ceiling is below X or others used more than
                                           timing.QUIET_OTHERS cores in 3 attempts
                                           5 s apart (a busy machine)
"""

from __future__ import annotations

import argparse
import sys
import time

import accel.course  # noqa: F401  (first, before TensorFlow: the course's settings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    dev = sub.add_parser("devices", help="print the device report")
    dev.add_argument("--count", type=int, default=None,
                     help="also create this many logical devices with accel.devices.setup")
    bench = sub.add_parser("bench", help="run a benchmark; prints ratios against its baseline")
    bench.add_argument("names", nargs="*", help="benchmark names (see --list), or 'all'")
    bench.add_argument("--list", action="store_true", help="list the benchmarks")
    bench.add_argument("--quick", action="store_true", help="a tiny run that checks it works")
    img = sub.add_parser("images", help="regenerate the course figures")
    img.add_argument("names", nargs="*", help="only these figures, e.g. 10_schedules.png")
    img.add_argument("--out", default="images", help="output folder (default: images)")
    ceil = sub.add_parser("ceiling", help="1-thread / 2-thread matmul time now (2 = two free "
                          "cores); with --require, fail on a busy machine")
    ceil.add_argument("--require", type=float, default=None, metavar="X",
                      help="exit with status 1 if the ceiling is below X (or other processes "
                           "used more than timing.QUIET_OTHERS cores) in every attempt")
    ceil.add_argument("--attempts", type=int, default=3,
                      help="with --require: measurements, 5 s apart, before giving up (a "
                           "single low reading can be a blip on a shared machine)")
    rec = sub.add_parser("hardware-record", help="measure achievable matmul and copy "
                         "figures of this machine's device and write a JSON record")
    rec.add_argument("--backend", nargs="*", default=None,
                     help="numpy (the CPU), cupy and/or torch (a CUDA GPU); default: every GPU "
                          "backend installed here, else numpy")
    rec.add_argument("--out", default=None,
                     help="the JSON file to write (default: hardware-record-<device>-<date>.json)")
    rec.add_argument("--quick", action="store_true", help="tiny sizes: checks that it works")
    rec.add_argument("--repeat", type=int, default=5, help="timings per figure (median)")
    args = parser.parse_args(argv)

    if args.command == "devices":
        from accel import devices

        if args.count is not None:
            devices.setup(args.count)
        print(devices.report())
    elif args.command == "bench":
        from accel.course import registry

        if args.list or not args.names:
            print("\n".join(registry.list_lines()))
            return 0
        names = None if args.names == ["all"] else args.names
        try:
            registry.run_all(names, quick=args.quick)
        except ValueError as exc:
            parser.error(str(exc))
    elif args.command == "ceiling":
        from accel import timing

        for attempt in range(1 if args.require is None else args.attempts):
            measured = timing.measure_ceiling()
            print(timing.ceiling_line(measured), flush=True)
            if args.require is None:
                break
            try:
                timing.require_quiet(args.require, measured=measured)
                break
            except RuntimeError as exc:
                if attempt + 1 == args.attempts:  # busy every time: not a passing blip
                    print(exc, file=sys.stderr)
                    return 1
                time.sleep(5)
    elif args.command == "hardware-record":
        from accel.costmodel import record

        names = args.backend
        if not names:
            found = record.available_backends()
            names = [b for b in found if b != "numpy"] or ["numpy"]
        sizes = record.SIZES["quick"] if args.quick else None
        try:
            found = record.record(names, sizes=sizes, repeat=args.repeat)
        except ValueError as exc:
            parser.error(str(exc))
        slug = "".join(c if c.isalnum() else "-" for c in found["device"]["device"]).strip("-")
        out = args.out or f"hardware-record-{slug}-{found['date']}.json"
        print(record.format_record(found))
        print("written:", record.write_record(found, out))
    elif args.command == "images":
        from accel import devices
        from accel.course import registry

        devices.setup(registry.BENCH_DEVICES)  # figures that place ops need the course's devices
        try:
            paths = registry.save_figures(args.out, args.names or None)
        except ValueError as exc:
            parser.error(str(exc))
        for path in paths:
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
