"""``doracheck`` entry point; exit codes (0, 1, 2, 130, 141) as in docs/cli.md: usage errors are
one line on stderr, never a traceback."""

from __future__ import annotations

import argparse
import sys

from . import audit_cmd, bench_cmd, calibrate_cmd, env_cmd, sample_cmd, verify_cmd

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse exits 2 already; keep the message on one line
        self.print_usage(sys.stderr)
        print(f"doracheck: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="doracheck", description="Fast, verified DoRA: kernels, oracles and checks.")
    parser.add_argument("--version", action=env_cmd.VersionAction, help="print the versions of doracheck, torch and triton and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    env_cmd.add_parser(sub)
    verify_cmd.add_parser(sub)
    audit_cmd.add_parser(sub)
    sample_cmd.add_parser(sub)
    calibrate_cmd.add_parser(sub)
    bench_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:  # the long commands report their own; this covers the rest (env, imports)
        return verify_cmd.interrupted(args.command)


if __name__ == "__main__":
    raise SystemExit(main())
