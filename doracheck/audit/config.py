"""``adapter_config.json`` as the audit reads it, with every value it uses type-checked.

PEFT writes these keys with fixed JSON types; a hand-edited or foreign config that breaks them
would crash the audit or be read wrongly (``"false"`` is a true string, ``2.7`` is not a rank).
Each bad value becomes one line naming the key, what was expected and what was found, all
reported together as one ``AuditInputError`` (exit 2). Keys read: r, lora_alpha, rank_pattern,
alpha_pattern (regular expression -> value, as in PEFT), use_rslora, use_dora, fan_in_fan_out,
target_modules (type only); absent or null: PEFT's default.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from .reader import AuditInputError


def _got(value) -> str:
    """A JSON value and its JSON type, as a user reads them: '"two" (string)', '2.7 (number)'."""
    if value is None:
        return "null"
    kind = {bool: "boolean", str: "string", int: "integer", float: "number", list: "list", dict: "object"}.get(type(value), "value")
    text = json.dumps(value)
    return f"{text if len(text) <= 40 else text[:37] + '...'} ({kind})"


class _Problems:
    def __init__(self, path: Path):
        self.path = path
        self.lines: list[str] = []

    def add(self, key: str, expected: str, value) -> None:
        self.lines.append(f"{self.path}: {key} must be {expected}, got {_got(value)}")


def _positive_int(problems: _Problems, key: str, value) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    problems.add(key, "a positive integer", value)
    return None


def _positive_number(problems: _Problems, key: str, value) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    problems.add(key, "a positive finite number", value)
    return None


def _flag(problems: _Problems, raw: dict, key: str, default: bool | None) -> bool | None:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    problems.add(key, "true or false", value)
    return default


def _pattern(problems: _Problems, raw: dict, key: str, check) -> dict:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.add(key, "an object mapping module patterns to values", value)
        return {}
    out = {}
    for pattern, entry in value.items():
        try:
            re.compile(pattern)
        except (re.error, OverflowError, RecursionError) as exc:  # a repeat count too large, nesting too deep
            shown = pattern if len(pattern) <= 60 else pattern[:57] + "..."
            problems.lines.append(f"{problems.path}: {key} pattern {shown!r} is not a valid regular expression ({exc})")
            continue
        checked = check(problems, f"{key}[{json.dumps(pattern)}]", entry)
        if checked is not None:
            out[pattern] = checked
    return out


@dataclass
class AdapterConfig:
    r: int | None = None
    lora_alpha: float | None = None
    use_rslora: bool = False
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    use_dora: bool | None = None
    fan_in_fan_out: bool = False
    source: str | None = None

    @classmethod
    def load(cls, path: Path) -> AdapterConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise AuditInputError(f"{path}: cannot read: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise AuditInputError(f"{path}: not a UTF-8 text file (expected PEFT's adapter_config.json)") from None
        except json.JSONDecodeError as exc:
            raise AuditInputError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        except (ValueError, RecursionError) as exc:  # nested too deep, a number too long
            raise AuditInputError(f"{path}: not usable JSON ({exc.__class__.__name__}: {str(exc)[:80]})") from None
        if not isinstance(raw, dict):
            raise AuditInputError(f"{path}: not a JSON object")
        return cls.from_dict(raw, path)

    @classmethod
    def from_dict(cls, raw: dict, path: Path) -> AdapterConfig:
        problems = _Problems(path)
        r = None if raw.get("r") is None else _positive_int(problems, "r", raw["r"])
        alpha = None if raw.get("lora_alpha") is None else _positive_number(problems, "lora_alpha", raw["lora_alpha"])
        config = cls(
            r=r,
            lora_alpha=alpha,
            use_rslora=bool(_flag(problems, raw, "use_rslora", False)),
            rank_pattern=_pattern(problems, raw, "rank_pattern", _positive_int),
            alpha_pattern=_pattern(problems, raw, "alpha_pattern", _positive_number),
            use_dora=_flag(problems, raw, "use_dora", None),
            fan_in_fan_out=bool(_flag(problems, raw, "fan_in_fan_out", False)),
            source=str(path),
        )
        targets = raw.get("target_modules")
        if not (targets is None or isinstance(targets, str) or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
            problems.add("target_modules", "a string, a list of strings or null", targets)
        if problems.lines:
            raise AuditInputError(*problems.lines)
        return config
