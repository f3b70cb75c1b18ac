"""``doracheck sample PATH [--fresh]``: write a small sample DoRA adapter and its base model
(``audit.sample``) into the folder PATH, never overwriting, then print the audit command to run
next. Exit codes: 0 written, 2 unusable PATH (one line naming it), 130 interrupted.
"""

from __future__ import annotations

import shlex
import sys


def make(path: str, fresh: bool, command: str = "doracheck sample") -> int:
    from doracheck.audit import AuditInputError
    from doracheck.audit.sample import FILES, LAYERS, write_sample
    try:
        folder = write_sample(path, fresh=fresh)
    except AuditInputError as exc:
        for line in exc.lines:
            print(f"{command}: {line}", file=sys.stderr)
        return 2
    kind = "an untrained (fresh)" if fresh else "a trained-like"
    print(f"wrote {kind} sample DoRA adapter ({len(LAYERS)} modules, r = 8, lora_alpha = 16) and its base model to {folder}: "
          f"{', '.join(FILES)}")
    audit = f"doracheck audit {shlex.quote(str(folder))} --base {shlex.quote(str(folder / 'base_model.safetensors'))}"
    print(f"next: {audit}")
    return 0


def run(args) -> int:
    from doracheck.cli.verify_cmd import guarded
    return guarded("sample", lambda a: make(a.path, a.fresh), args)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sample",
        help="write a small sample DoRA adapter and its base model (never overwrites)",
        description="Write a small sample DoRA adapter in PEFT's format (adapter_model.safetensors, adapter_config.json) and its "
        "base model (base_model.safetensors) into PATH, then print the audit command to try. The folder is created if "
        "missing; an existing file is never overwritten (exit 2).",
    )
    p.add_argument("path", metavar="PATH", help="folder to write the three files into (new, or without them)")
    p.add_argument("--fresh", action="store_true",
                   help="an untrained adapter as PEFT initialises it (lora_B = 0, magnitude = ||W||) instead of a trained-like one")
    p.set_defaults(run=run)
