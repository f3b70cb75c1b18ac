"""Safe, lazy access to safetensors files (adapters and base models) for the audit.

Nothing here runs code from a file (safetensors only, no pickle) or reads more than it needs: the header
is validated first with our own limits, then tensors are read one at a time (``safetensors.safe_open``,
memory-mapped: a 70B base is never in RAM). Every problem is a one-line ``AuditInputError`` naming the file.
"""

from __future__ import annotations

import json
import os
import struct
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
}


class AuditInputError(Exception):
    """Unusable input: ``lines``, one per problem (a config may have several), naming the file."""

    def __init__(self, *lines: str):
        self.lines = list(lines) or ["unusable input"]
        super().__init__("; ".join(self.lines))


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_RESAVE = {
    "adapter": "re-save it with PEFT: PeftModel.from_pretrained(base_model, {src!r}).save_pretrained({out!r}, safe_serialization=True)",
    "base": "re-save it with transformers: AutoModelForCausalLM.from_pretrained({src!r}).save_pretrained({out!r}, "
    "safe_serialization=True)",
}


def pickle_error(path: Path, what: str, role: str) -> AuditInputError:
    """One-line refusal of a PyTorch pickle (``what``: what was found), with its folder's re-save recipe."""
    folder = path if path.is_dir() else path.parent
    if folder.name in ("", ".", ".."):
        folder = folder.resolve()
    out = folder.parent / f"{folder.name or 'model'}-safetensors"
    how = _RESAVE.get(role, _RESAVE["adapter"]).format(src=str(folder), out=str(out))
    return AuditInputError(
        f"{path}: {what}; doracheck reads only safetensors and never unpickles user files (unpickling runs code from the file): {how}"
    )


def pickle_kind(path: Path, prefix: bytes) -> str | None:
    """How ``path`` looks like a PyTorch pickle checkpoint (first bytes and name), or None. Only files
    without a safetensors header ('{' at byte 8) are judged: zip magic PK\\x03\\x04 (torch.save), pickle
    protocol 2-5 magic \\x80 0x02..0x05 (old torch.save, pickle.dump), or a .bin/.pt/.pth/.ckpt/.pkl name."""
    if prefix[8:9] == b"{":
        return None
    if prefix.startswith(b"PK\x03\x04"):
        return "a zip archive (PyTorch's torch.save format), not safetensors"
    if len(prefix) >= 2 and prefix[0] == 0x80 and 2 <= prefix[1] <= 5:
        return "a Python pickle (legacy torch.save format), not safetensors"
    if path.suffix.lower() in PICKLE_SUFFIXES:
        return f"a {path.suffix} file that is not safetensors (PyTorch pickle checkpoints use this name)"
    return None


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _fail(path: Path, problem: str) -> AuditInputError:
    return AuditInputError(f"{path}: {problem}")


def special_file(path: Path) -> AuditInputError | None:
    """The error for an existing path neither a file nor a folder (/dev/null, a pipe, a socket), else None."""
    if path.exists() and not path.is_file() and not path.is_dir():
        return _fail(path, "is a device or special file, not a safetensors file or a folder holding one")
    return None


def read_header(path: Path, role: str = "adapter") -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """(tensors, metadata) of a validated safetensors header (sizes, JSON, dtypes, shapes, offsets in bounds,
    sized to shape, disjoint); a pickle is refused with its re-save recipe (``role``: "adapter" or "base")."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(9)
            what = pickle_kind(path, prefix)
            if what is not None:
                raise pickle_error(path, what, role)
            if prefix.lstrip()[:1] in (b"{", b"["):
                hint = " (the config beside an adapter: pass adapter_model.safetensors or its folder)" if role == "adapter" else ""
                raise _fail(path, f"this is a JSON file{hint}, not a safetensors file")
            prefix = prefix[:8]
            f.seek(8)
            if len(prefix) < 8:
                raise _fail(path, f"truncated: {size} bytes is shorter than the 8-byte safetensors header length")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                raise _fail(path, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupt or not safetensors)")
            if n > size - 8:
                raise _fail(path, f"header length {n} runs past the end of the file ({size} bytes)")
            raw = f.read(n)
    except OSError as exc:
        raise _fail(path, f"cannot read: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError, JSONDecodeError, too deep or too long a number
        raise _fail(path, f"header is not valid JSON ({exc.__class__.__name__}: {str(exc)[:80]})") from None
    if not isinstance(header, dict):
        raise _fail(path, "header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _fail(path, "__metadata__ must map strings to strings")
    data_size = size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise _fail(path, f"tensor {name!r}: entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in _DTYPE_BYTES:
            raise _fail(path, f"tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise _fail(path, f"tensor {name!r}: shape must be a list of non-negative integers, got {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise _fail(path, f"tensor {name!r}: data_offsets must be [begin, end], got {offsets!r}")
        begin, end = offsets
        if not (0 <= begin <= end <= data_size):
            raise _fail(path, f"tensor {name!r}: data_offsets {offsets} run past the data section ({data_size} bytes)")
        numel = 1
        for d in shape:
            numel *= d
        if numel * _DTYPE_BYTES[dtype] != end - begin:
            raise _fail(
                path, f"tensor {name!r}: shape {shape} of {dtype} needs {numel * _DTYPE_BYTES[dtype]} bytes, offsets give {end - begin}"
            )
        tensors[name] = TensorInfo(dtype, tuple(shape), begin, end)
    spans = sorted((t.begin, t.end, k) for k, t in tensors.items() if t.end > t.begin)
    for (_b0, e0, k0), (b1, _e1, k1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise _fail(path, f"tensors {k0!r} and {k1!r} overlap in the data section")
    return tensors, metadata


class SafetensorsFile:
    """One validated file; ``get(name)`` reads a single tensor (CPU)."""

    def __init__(self, path: Path, role: str = "adapter"):
        from safetensors import SafetensorError, safe_open
        self.path = Path(path)
        self.tensors, self.metadata = read_header(self.path, role)
        self._stack = ExitStack()
        self._error = SafetensorError
        try:
            self._handle = self._stack.enter_context(safe_open(str(self.path), framework="pt", device="cpu"))
        except (SafetensorError, OSError) as exc:
            raise _fail(self.path, f"rejected by safetensors: {str(exc).splitlines()[0][:120]}") from None

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handle.get_tensor(name)
        except (self._error, OSError, RuntimeError) as exc:
            raise _fail(self.path, f"tensor {name!r} could not be read: {str(exc).splitlines()[0][:120]}") from None

    def close(self) -> None:
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class BaseWeights:
    """Base-model weights from one file, a sharded folder (model.safetensors.index.json), or a
    folder with a single safetensors file. Files are opened on first use, one tensor at a time."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._files: dict[Path, SafetensorsFile] = {}
        self._where: dict[str, Path] = {}
        if self.path.is_dir():
            index = self.path / "model.safetensors.index.json"
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
                except OSError as exc:
                    raise _fail(index, f"cannot read: {exc.strerror or exc}") from None
                except UnicodeDecodeError:
                    raise _fail(index, "not a UTF-8 text file (expected a JSON index of the shards)") from None
                except (ValueError, RecursionError, AttributeError) as exc:  # JSONDecodeError is a ValueError
                    raise _fail(index, f"unreadable index: {exc.__class__.__name__}: {str(exc)[:80]}") from None
                if not isinstance(weight_map, dict):
                    raise _fail(index, "no weight_map object")
                for key, shard in weight_map.items():
                    shard_path = (self.path / str(shard)).resolve()
                    if self.path.resolve() not in shard_path.parents:
                        raise _fail(index, f"shard {shard!r} lies outside the folder")
                    self._where[key] = shard_path
            else:
                files = sorted(p for p in self.path.glob("*.safetensors") if p.is_file())
                if not files:
                    pickles = _pickles_in(self.path)
                    if pickles:
                        raise pickle_error(self.path, f"has {pickles[0]} (a PyTorch pickle checkpoint) but no *.safetensors", "base")
                if len(files) != 1:
                    raise _fail(self.path, f"expected one *.safetensors file or model.safetensors.index.json, found {len(files)}")
                self._index_file(files[0])
        elif self.path.is_file():
            self._index_file(self.path)
        else:
            raise special_file(self.path) or _fail(self.path, "no such file or folder")

    def _index_file(self, path: Path) -> None:
        handle = self._open(path)
        for key in handle.tensors:
            self._where[key] = path

    def _open(self, path: Path) -> SafetensorsFile:
        if path not in self._files:
            if not path.is_file():
                raise _fail(path, "shard named in the index is missing")
            self._files[path] = SafetensorsFile(path, "base")
        return self._files[path]

    def find(self, module: str) -> str | None:
        """The key of ``module``'s weight, matched as PEFT names it (``<module>.weight`` or
        ``<module>.base_layer.weight``), allowing a leading ``model.`` difference."""
        candidates = [f"{module}.weight", f"{module}.base_layer.weight"]
        for key in list(candidates):
            if key.startswith("model."):
                candidates.append(key[len("model."):])
            else:
                candidates.append("model." + key)
        for key in candidates:
            if key in self._where:
                return key
        return None

    def keys(self) -> list[str]:
        return list(self._where)

    def info(self, key: str) -> TensorInfo:
        return self._open(self._where[key]).tensors[key]

    def get(self, key: str) -> torch.Tensor:
        return self._open(self._where[key]).get(key)

    def close(self) -> None:
        for f in self._files.values():
            f.close()


def _pickles_in(folder: Path) -> list[str]:
    """Names of PyTorch pickle checkpoints in ``folder`` (by name), PEFT's and transformers' first."""
    found = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES)
    known = [n for n in ("adapter_model.bin", "pytorch_model.bin") if n in found]
    return known + [n for n in found if n not in known]


def adapter_file(path: Path) -> Path:
    """The adapter file for PATH: the file itself, or adapter_model.safetensors in a folder."""
    path = Path(path)
    if path.is_dir():
        candidate = path / "adapter_model.safetensors"
        if candidate.is_dir():
            raise _fail(candidate, "is a folder, not a file; the adapter is the file adapter_model.safetensors that "
                        "PEFT's save_pretrained writes")
        if not candidate.is_file():
            pickles = _pickles_in(path)
            if pickles:
                raise pickle_error(path, f"has {pickles[0]} (a PyTorch pickle, as save_pretrained(..., safe_serialization=False) "
                                   "writes) but no adapter_model.safetensors", "adapter")
            others = sorted(p.name for p in path.glob("*.safetensors") if p.is_file())
            hint = f" (it has {', '.join(others[:3])}: pass the adapter file itself)" if others else ""
            raise _fail(path, f"folder has no adapter_model.safetensors{hint}")
        return candidate
    if path.is_file():
        return path
    raise special_file(path) or _fail(path, "no such file or folder")
