"""``doracheck sample`` and ``doracheck audit`` run as a user runs them: the installed command in
a subprocess, in a fresh folder, checking the exit code, the output, that no user file changed
(except a report the test asked for) and that no traceback is printed.

One test (or group) per item of the audit issue:
1. ``sample`` never overwrites, creates the folder, prints the next command; ``audit --make-sample``
   is a deprecated alias with the same rule.
2. wrongly typed adapter_config.json values: exit 2, one line per key (key, expected, got).
3. a --base that matches no module: exit 2; a plain LoRA adapter: a visible notice, exit 0
   (1 under --strict).
4. a fresh adapter (the sample's and PEFT's) reports 0% 16-bit collapse.
5. the norm-memory line compares like with like (factored below dense).
6. natural module order, a legend of every column, --verbose for info findings, a progress
   bar only on a terminal.
7. pickle checkpoints (.bin/.pt, zip or legacy) are refused with the re-save recipe, never loaded.
8. --report writes one self-contained HTML file holding the run's results; without matplotlib
   it exits 2 before auditing.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from cli_run import doracheck_command, one_line, require_matplotlib, run_clean, snapshot
from peft_models import TARGETS, tiny_llama
from safetensors.torch import load_file, save_file

MODULES = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
           "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]




@pytest.fixture(scope="module")
def sample_src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("src")
    proc = run_clean(["sample", "trained"], root)
    assert proc.returncode == 0, proc.stderr
    proc = run_clean(["sample", "fresh", "--fresh"], root)
    assert proc.returncode == 0, proc.stderr
    return root


@pytest.fixture
def work(tmp_path, sample_src) -> Path:
    """tmp_path holding a copy of the trained-like sample in s/ and the fresh one in f/."""
    shutil.copytree(sample_src / "trained", tmp_path / "s")
    shutil.copytree(sample_src / "fresh", tmp_path / "f")
    return tmp_path


def _audit(work: Path, *extra: str, folder: str = "s", base: bool = True, env: dict | None = None):
    args = ["audit", folder, *(["--base", f"{folder}/base_model.safetensors"] if base else []), "--device", "cpu", *extra]
    before = snapshot(work)
    proc = run_clean(args, work, env=env)
    after = snapshot(work)
    report = next((extra[i + 1] for i, a in enumerate(extra) if a == "--report"), None)
    after.pop(report, None)
    assert after == before, "the audit changed user files"
    return proc


# --- 1. sample -------------------------------------------------------------------------------


def test_sample_creates_folder_and_prints_next_command(tmp_path):
    proc = run_clean(["sample", "new/sub"], tmp_path)
    assert proc.returncode == 0 and proc.stderr == ""
    assert sorted(os.listdir(tmp_path / "new/sub")) == ["adapter_config.json", "adapter_model.safetensors", "base_model.safetensors"]
    assert "next: doracheck audit new/sub --base new/sub/base_model.safetensors" in proc.stdout
    follow = run_clean(proc.stdout.strip().splitlines()[-1].removeprefix("next: doracheck ").split(), tmp_path)
    assert follow.returncode == 0 and "4 modules" in follow.stdout


def test_sample_never_overwrites_a_real_adapter(work):
    real = work / "real"
    real.mkdir()
    save_file({"base_model.model.x.lora_A.weight": torch.ones(2, 3)}, str(real / "adapter_model.safetensors"))
    (real / "adapter_config.json").write_text('{"r": 2, "lora_alpha": 4, "use_dora": true}')
    before = snapshot(work)
    for args in (["sample", "real"], ["sample", "real", "--fresh"]):
        proc = run_clean(args, work)
        assert proc.returncode == 2 and proc.stdout == ""
        assert one_line(proc).startswith("doracheck sample: real/adapter_model.safetensors: already exists")
    assert snapshot(work) == before
    only_config = work / "partial"
    only_config.mkdir()
    (only_config / "adapter_config.json").write_text("{}")
    before = snapshot(work)
    proc = run_clean(["sample", "partial"], work)
    assert proc.returncode == 2 and "partial/adapter_config.json: already exists" in one_line(proc)
    assert snapshot(work) == before  # nothing written, not even the files that were missing


def test_sample_on_a_file_is_refused(work):
    before = snapshot(work)
    proc = run_clean(["sample", "s/adapter_model.safetensors"], work)
    assert proc.returncode == 2 and "is a file" in one_line(proc)
    assert snapshot(work) == before


def test_make_sample_is_a_deprecated_alias_that_never_overwrites(work):
    before = snapshot(work)
    for target in ("s", "s/adapter_model.safetensors"):
        proc = run_clean(["audit", target, "--make-sample"], work)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 2 and "deprecated" in lines[0] and "doracheck sample" in lines[0]
        assert "already exists" in lines[1] or "is a file" in lines[1]
    assert snapshot(work) == before
    proc = run_clean(["audit", "fresh_dir", "--make-sample"], work)
    assert proc.returncode == 0 and "deprecated" in proc.stderr and (work / "fresh_dir/adapter_model.safetensors").is_file()
    assert "--make-sample" not in run_clean(["audit", "--help"], work).stdout


# --- 2. config values ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,expected",
    [
        ({"rank_pattern": {"q_proj": "two"}}, 'rank_pattern["q_proj"] must be a positive integer, got "two" (string)'),
        ({"alpha_pattern": {"q_proj": None}}, 'alpha_pattern["q_proj"] must be a positive finite number, got null'),
        ({"use_rslora": "false"}, 'use_rslora must be true or false, got "false" (string)'),
        ({"r": 2.7}, "r must be a positive integer, got 2.7 (number)"),
    ],
    ids=["rank_pattern_str", "alpha_pattern_null", "use_rslora_str", "r_float"],
)
def test_wrongly_typed_config_value_exits_2(work, change, expected):
    cfg = json.loads((work / "s/adapter_config.json").read_text())
    (work / "s/adapter_config.json").write_text(json.dumps({**cfg, **change}))
    proc = _audit(work)
    assert proc.returncode == 2 and proc.stdout == ""
    assert one_line(proc) == f"doracheck audit: s/adapter_config.json: {expected}"


def test_every_bad_config_value_gets_its_own_line(work):
    cfg = json.loads((work / "s/adapter_config.json").read_text())
    bad = {"lora_alpha": "16", "fan_in_fan_out": 0, "use_dora": "yes", "target_modules": 3, "rank_pattern": {"(q": 2}}
    (work / "s/adapter_config.json").write_text(json.dumps({**cfg, **bad}))
    proc = _audit(work)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == len(bad)
    for key in bad:
        assert sum(key in line for line in lines) == 1, (key, lines)
    assert all(line.startswith("doracheck audit: s/adapter_config.json: ") for line in lines)


# --- 3. base that matches nothing; plain LoRA ------------------------------------------------


def test_base_matching_no_module_exits_2(work):
    save_file({"encoder.block.0.weight": torch.zeros(3, 3), "encoder.block.1.weight": torch.zeros(3, 3)}, str(work / "other.safetensors"))
    before = snapshot(work)
    proc = run_clean(["audit", "s", "--base", "other.safetensors", "--device", "cpu"], work)
    assert proc.returncode == 2 and proc.stdout == ""
    line = one_line(proc)
    assert "matches none of the adapter's 4 DoRA modules" in line
    assert "'model.layers.0.self_attn.q_proj.weight'" in line and "'encoder.block.0.weight'" in line
    assert snapshot(work) == before


def _plain_lora(work: Path) -> None:
    tensors = load_file(str(work / "s/adapter_model.safetensors"))
    save_file({k: v for k, v in tensors.items() if "magnitude" not in k}, str(work / "s/adapter_model.safetensors"))
    cfg = json.loads((work / "s/adapter_config.json").read_text())
    (work / "s/adapter_config.json").write_text(json.dumps({**cfg, "use_dora": False}))


def test_plain_lora_adapter_says_so(work):
    _plain_lora(work)
    proc = _audit(work)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1] == "notice: this is a LoRA adapter without DoRA magnitudes: nothing DoRA-specific to audit"
    assert "(plain LoRA: nothing DoRA-specific audited)" in proc.stdout
    row = next(line for line in lines if line.startswith(MODULES[0]))
    assert row.split() == [MODULES[0], "8", "96→64", "2", "0", "0"]  # structure is still read, no '?' row
    assert _audit(work, "--strict").returncode == 1
    doc = json.loads(_audit(work, "--json").stdout)
    assert doc["plain_lora"] is True and doc["summary"]["dora_modules"] == 0


# --- 4. fresh adapters: no collapse ----------------------------------------------------------


def _collapse(doc) -> list[tuple[float, float, int]]:
    return [(m["collapse_bf16"], m["collapse_fp16"], m["g"]["learned"]) for m in doc["modules"]]


def test_fresh_sample_reports_no_collapse_trained_one_does(work):
    fresh = json.loads(_audit(work, "--json", folder="f").stdout)
    assert _collapse(fresh) == [(0.0, 0.0, 0)] * 4
    text = _audit(work, folder="f").stdout
    for name in MODULES:
        row = next(line for line in text.splitlines() if line.startswith(name)).split()
        assert row[8].startswith("0/") and row[9] == "0%" and row[10] == "0%", row
    trained = json.loads(_audit(work, "--json").stdout)
    for m in trained["modules"]:  # a real learned signal below bf16's resolution is still reported
        assert m["g"]["learned"] == m["d_out"] and m["collapse_bf16"] > 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_fresh_peft_adapter_reports_no_collapse(tmp_path, dtype):
    peft = pytest.importorskip("peft")
    pytest.importorskip("transformers")
    model = tiny_llama(0, dtype)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "base.safetensors"))
    peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, use_dora=True, target_modules=TARGETS)).save_pretrained(
        str(tmp_path / "adapter"))
    before = snapshot(tmp_path)
    proc = run_clean(["audit", "adapter", "--base", "base.safetensors", "--json", "--device", "cpu"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert len(doc["modules"]) == 14 and _collapse(doc) == [(0.0, 0.0, 0)] * 14
    assert snapshot(tmp_path) == before


# --- 5. memory line --------------------------------------------------------------------------


def test_memory_line_compares_like_with_like(work):
    proc = _audit(work)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("norm scratch at the largest module"))
    assert "(model.layers.0.self_attn.q_proj, 64×96, r = 8), fp32" in line and "× less)" in line
    mem = json.loads(_audit(work, "--json").stdout)["summary"]["memory_bytes"]
    assert mem["dense_norm"] == 4 * 64 * 96 and mem["factored_norm"] == 4 * (64 * 8 + 8 * 8 + 4 * 64) < mem["dense_norm"]
    assert "norm scratch:" in _audit(work, env={"CI": ""}).stdout  # explained in the legend (off under CI)


# --- 6. order, legend, verbose, progress -----------------------------------------------------


def test_modules_in_natural_order(tmp_path):
    tensors = {}
    for layer in (10, 2, 1, 11, 0):
        prefix = f"base_model.model.layers.{layer}.proj"
        tensors.update({f"{prefix}.lora_A.weight": torch.randn(2, 4), f"{prefix}.lora_B.weight": torch.randn(3, 2),
                        f"{prefix}.lora_magnitude_vector": torch.rand(3) + 1})
    save_file(tensors, str(tmp_path / "a.safetensors"))
    proc = run_clean(["audit", "a.safetensors", "--json"], tmp_path)
    assert [m["name"] for m in json.loads(proc.stdout)["modules"]] == [f"layers.{i}.proj" for i in (0, 1, 2, 10, 11)]
    text = run_clean(["audit", "a.safetensors"], tmp_path).stdout
    rows = [line.split()[0] for line in text.splitlines() if line.startswith("layers.")]
    assert rows == [f"layers.{i}.proj" for i in (0, 1, 2, 10, 11)]


def test_legend_explains_every_column_and_verbose_shows_info(work):
    from doracheck.audit.summary import HEADER

    proc = _audit(work, env={"CI": ""})  # the legend is left out under CI
    assert proc.returncode == 0 and proc.stderr == ""
    table, legend = proc.stdout.split("\nlegend:\n", 1)
    assert "\nfindings:\n" not in legend and "info findings not shown" in table
    entries = [line.strip().split(": ", 1)[0] for line in legend.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    for column in HEADER:
        assert any(column in entry for entry in entries), (column, entries)
    assert "Warning when the median exceeds 8 ulp" in " ".join(legend.split())
    assert "scale.collapse_bf16" not in proc.stdout and "info findings not shown: --verbose lists them" in proc.stdout
    verbose = _audit(work, "--verbose").stdout
    assert verbose.count("scale.collapse_bf16") == 4 and verbose.count("merge.ulp") == 4


def test_progress_bar_only_on_a_terminal(work):
    pty = pytest.importorskip("pty")
    import fcntl
    import struct
    import termios

    assert _audit(work).stderr == ""  # CI / pipe: no bar
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    pid, fd = pty.fork()
    if pid == 0:  # child: a terminal 120 columns wide
        try:
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
            os.chdir(work)
            cmd = [*doracheck_command(), "audit", "s", "--base", "s/base_model.safetensors", "--device", "cpu"]
            os.execve(cmd[0], cmd, env)
        finally:
            os._exit(127)
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.waitpid(pid, 0)
    assert b"audit:" in out and b"/4 [" in out and b"module" in out, out[-2000:]


# --- 7. pickle checkpoints -------------------------------------------------------------------


class _Marker:
    """Unpickling this creates a file: proof that nothing loaded the pickle."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_folder_saved_without_safe_serialization(work):
    marker = work / "UNPICKLED"
    (work / "s/adapter_model.safetensors").unlink()
    torch.save({"weights": torch.zeros(2), "boom": _Marker(str(marker))}, str(work / "s/adapter_model.bin"))
    before = snapshot(work)
    proc = run_clean(["audit", "s", "--base", "s/base_model.safetensors"], work)
    assert proc.returncode == 2 and proc.stdout == ""
    line = one_line(proc)
    assert "has adapter_model.bin (a PyTorch pickle" in line and "never unpickles" in line
    assert "PeftModel.from_pretrained(base_model, 's').save_pretrained('s-safetensors', safe_serialization=True)" in line
    assert snapshot(work) == before and not marker.exists()


@pytest.mark.parametrize("name,legacy", [("adapter_model.bin", False), ("model.pt", False), ("legacy.bin", True), ("noext", True)])
def test_pickle_file_is_refused_not_loaded(work, name, legacy):
    marker = work / "UNPICKLED"
    if legacy:
        (work / name).write_bytes(pickle.dumps({"boom": _Marker(str(marker))}, protocol=2))
    else:
        torch.save({"boom": _Marker(str(marker))}, str(work / name))
    before = snapshot(work)
    proc = run_clean(["audit", name], work)
    assert proc.returncode == 2
    line = one_line(proc)
    kind = "a Python pickle (legacy torch.save format)" if legacy else "a zip archive (PyTorch's torch.save format)"
    assert line.startswith(f"doracheck audit: {name}: {kind}, not safetensors; doracheck reads only safetensors")
    assert "safe_serialization=True" in line and "header length" not in line
    base = run_clean(["audit", "s", "--base", name], work)
    assert base.returncode == 2 and "AutoModelForCausalLM.from_pretrained" in one_line(base)
    assert snapshot(work) == before and not marker.exists()


# --- 8. HTML report --------------------------------------------------------------------------


def test_html_report_holds_the_results(work):
    require_matplotlib()
    proc = _audit(work, "--report", "report.html")
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("report: report.html")
    page = (work / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 4
    for name in MODULES:
        assert page.count(name) >= 3  # table row, findings, module section
    assert "summary: 4 modules, 0 errors, 0 warnings" in page and "merge/bound" in page and "2^-9" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page) and "<link" not in page  # self-contained


def test_html_report_shows_findings(work):
    require_matplotlib()
    tensors = load_file(str(work / "s/adapter_model.safetensors"))
    tensors[f"base_model.model.{MODULES[1]}.lora_magnitude_vector"][5] = 0.0
    save_file(tensors, str(work / "s/adapter_model.safetensors"))
    proc = _audit(work, "--report", "out.html")
    assert proc.returncode == 1
    page = (work / "out.html").read_text()
    assert "magnitude.nonpositive" in page and "summary: 4 modules, 1 errors" in page and 'class="fail"' in page


def test_report_without_matplotlib_exits_2_before_auditing(work):
    fake = work / "fake_site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(work / "fake_site"), os.environ.get("PYTHONPATH", "")])}
    before = snapshot(work)
    proc = run_clean(["audit", "s", "--base", "s/base_model.safetensors", "--report", "r.html"], work, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert one_line(proc) == "doracheck audit: --report: the HTML report needs matplotlib: pip install matplotlib"
    assert snapshot(work) == before


def test_report_path_that_cannot_be_written(work):
    require_matplotlib()
    before = snapshot(work)
    for target, why in (("nowhere/r.html", "no such folder"), ("s", "is a folder"), ("s/adapter_config.json", "input files")):
        proc = run_clean(["audit", "s", "--report", target], work)
        assert proc.returncode == 2 and why in one_line(proc)
    assert snapshot(work) == before


@pytest.mark.parametrize("weight_dtype", [None, torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_implementation_bound_counts_the_split_of_adapters_of_another_dtype(monkeypatch, weight_dtype, adapter_dtype):
    """The audit's ``implementation_bound`` on the Triton path is the bound of the norm path
    that runs for these adapters on this base (``settings.cublas_cross_pieces``: fp32 adapters
    on a 16-bit base are split into two pieces, U of 2r columns); with the base's dtype unknown,
    the largest over 16-bit bases, so never below what any of them allocates."""
    from doracheck import dispatch
    from doracheck.audit.checks import ModuleReport, check_memory, update_memory_bound
    from doracheck.kernels.settings import cublas_cross_pieces, triton_norm_memory_bound

    monkeypatch.setattr(dispatch, "choose_path", lambda device: dispatch.PathChoice("triton", "test"))
    d_out, d_in, r = 4096, 1024, 64

    def bound(w):
        report = ModuleReport(name="m", fmt="peft")
        check_memory(report, d_out, d_in, r, "cpu", adapter_dtype, adapter_dtype, w)
        mem = report.stats["memory_bytes"]
        assert mem["path"] == "triton" and mem["base_dtype"] == (None if w is None else str(w).replace("torch.", ""))
        return mem["implementation_bound"]

    got = bound(weight_dtype)
    if weight_dtype is None:
        assert got == max(bound(torch.bfloat16), bound(torch.float16))
    else:
        split = cublas_cross_pieces(weight_dtype, adapter_dtype) == 2
        assert got == triton_norm_memory_bound(d_out, d_in, r, adapter_dtype, split_adapters=split)
    if weight_dtype is torch.bfloat16 and adapter_dtype is torch.float32 and cublas_cross_pieces(weight_dtype, adapter_dtype) == 2:
        assert got - triton_norm_memory_bound(d_out, d_in, r, adapter_dtype) == 4 * r * (d_in + d_out)  # the two pieces and U's r more columns
    report = ModuleReport(name="m", fmt="peft")  # read the base later: the bound becomes that base's
    check_memory(report, d_out, d_in, r, "cpu", adapter_dtype, adapter_dtype)
    update_memory_bound(report, d_out, d_in, r, "cpu", adapter_dtype, adapter_dtype, torch.float32)
    assert report.stats["memory_bytes"]["implementation_bound"] == triton_norm_memory_bound(d_out, d_in, r, adapter_dtype)
