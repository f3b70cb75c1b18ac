"""``doracheck sample PATH [--fresh]``: write a small sample DoRA adapter and its base model.

PATH is a folder (created if missing) that receives adapter_model.safetensors,
adapter_config.json (PEFT's format: 4 modules, r = 8, lora_alpha = 16) and
base_model.safetensors; if any of the three exists nothing is written. Prints what it wrote and
the audit command to run next.

Exit codes: 0 written; 2 unusable PATH (a file, an existing sample file, unwritable), one line on
stderr naming the path; 130 interrupted. A failed or interrupted write removes what this run
wrote (the files, and folders it made) and nothing else.
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
