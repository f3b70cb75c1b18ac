"""``doracheck`` entry point; exit codes (0, 1, 2, 130, 141) as in docs/cli.md: usage errors are
one line on stderr, never a traceback."""

from __future__ import annotations

import argparse
import signal
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


def _import_torch_with_sigint_blocked() -> None:
    """Import torch with SIGINT blocked in this thread, so the threads its import starts inherit
    the block: a Ctrl-C then always reaches the main thread, even while it waits in a read (a
    thread that took it would leave that read blocked, and the command would not stop)."""
    if not hasattr(signal, "pthread_sigmask"):
        import torch  # noqa: F401
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        import torch  # noqa: F401
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # --help and --version end here, without torch
    try:
        _import_torch_with_sigint_blocked()
        return int(args.run(args))
    except KeyboardInterrupt:  # the long commands report their own; this covers the rest (env, imports)
        return verify_cmd.interrupted(args.command)


if __name__ == "__main__":
    raise SystemExit(main())
