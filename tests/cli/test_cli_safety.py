"""The commands never harm a user's files and never crash on odd input, run as the installed
``doracheck`` in a fresh folder: exit code, one line on stderr, no traceback, no user file
changed or removed.

1. ``--report`` (audit, verify) writes only a new .html file or an earlier doracheck report,
   checked before any work; 2. ``bench --csv`` leaves an existing file alone until a row exists
   and refuses a non-regular one; 3. Ctrl-C (130) and a closed stdout (141) in audit and sample;
   4. a module name holding ``$`` in the report's plots; 5. paths that cannot be read or written
   (a name too long; no permission); 6. a host out-of-memory in bench; 7. a regular expression
   with a huge repeat count in adapter_config.json; 8. a module with a zero dimension; 9. a shard
   index that is not UTF-8; 10. module names with non-ASCII digits; plus an fp64 base (merge error
   in fp32 ulps) and an adapter_model.safetensors that is a folder.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from cli_run import doracheck_command, one_line, require_matplotlib, run_clean, snapshot
from safetensors.torch import load_file, save_file

LONG = "a" * 300  # longer than a file name may be: every stat of it fails with ENAMETOOLONG, as root too
AUDIT = ["--device", "cpu"]
HUGE_BENCH = ["bench", "--tokens", "1", "--reps", "2", "--dtype", "fp32", "--mode", "infer"]
HUGE_SHAPE = "30000000x30000000r4"  # 3.6e15 bytes of fp32: beyond any address space, refused at once




def _refused(args, cwd, *phrases: str, code: int = 2) -> str:
    """Run, expect ``code`` with one line holding every phrase, nothing on stdout, no file changed."""
    before = snapshot(cwd)
    proc = run_clean(args, cwd)
    line = one_line(proc)
    assert proc.returncode == code and proc.stdout == "", (proc.returncode, proc.stdout, line)
    for phrase in phrases:
        assert phrase in line, line
    assert snapshot(cwd) == before
    return line


@pytest.fixture(scope="module")
def sample_src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("src")
    assert run_clean(["sample", "s"], root).returncode == 0
    return root / "s"


@pytest.fixture
def work(tmp_path, sample_src) -> Path:
    shutil.copytree(sample_src, tmp_path / "s")
    (tmp_path / "notes.html").write_text("<!DOCTYPE html><html><body>my own notes</body></html>\n")
    return tmp_path


def _adapter(folder: Path, modules: dict[str, tuple], base_dtype=torch.float32) -> None:
    """A PEFT DoRA adapter and its base: {module: (A shape, B shape, m shape, W shape)}."""
    folder.mkdir()
    gen = torch.Generator().manual_seed(0)
    adapter, base = {}, {}
    for name, (a, b, m, w) in modules.items():
        W = torch.randn(*w, generator=gen)
        adapter[f"base_model.model.{name}.lora_A.weight"] = torch.randn(*a, generator=gen)
        adapter[f"base_model.model.{name}.lora_B.weight"] = 0.01 * torch.randn(*b, generator=gen)
        adapter[f"base_model.model.{name}.lora_magnitude_vector"] = W.norm(dim=1) if w[0] else torch.zeros(m)
        base[f"{name}.weight"] = W.to(base_dtype)
    save_file(adapter, str(folder / "adapter_model.safetensors"))
    save_file(base, str(folder / "base.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "use_dora": True}))


SMALL = ((8, 16), (12, 8), (12,), (12, 16))


# --- 1. --report ------------------------------------------------------------------------------


@pytest.mark.parametrize("base,target,why", [
    (False, "s/base_model.safetensors", "give a name ending in .html"),  # the reviewer's case: the base model
    (True, "s/base_model.safetensors", "input files"),
    (True, "notes.html", "is not an HTML report written by doracheck"),
    (True, "s/adapter_config.json", "input files")])
def test_audit_report_never_replaces_a_file_it_did_not_write(work, base, target, why):
    # refused before the audit: nothing on stdout, every file as it was (the base model too)
    require_matplotlib()
    with_base = ["--base", "s/base_model.safetensors"] if base else []
    _refused(["audit", "s", *with_base, *AUDIT, "--report", target], work, why)


def test_audit_report_replaces_only_its_own_earlier_report(work):
    require_matplotlib()
    args = ["audit", "s", "--base", "s/base_model.safetensors", *AUDIT, "--report", "r.html"]
    assert run_clean(args, work).returncode == 0
    first = (work / "r.html").read_text()
    assert first.startswith("<!DOCTYPE html>") and '<meta name="generator" content="doracheck">' in first
    (work / "r.html").write_text(first.replace("summary:", "EDITED summary:"))
    before = snapshot(work)
    assert run_clean(args, work).returncode == 0
    after = snapshot(work)
    assert set(after) == set(before)  # no temporary file left behind
    assert {k for k in after if after[k] != before[k]} == {"r.html"} and "EDITED" not in (work / "r.html").read_text()


@pytest.mark.parametrize("target,why", [("s/base_model.safetensors", "give a name ending in .html"),
                                        ("notes.html", "is not an HTML report written by doracheck")])
def test_verify_report_never_replaces_a_file_it_did_not_write(work, target, why):
    require_matplotlib()
    _refused(["verify", "--quick", "--dtype", "fp32", "--report", target], work, why)


# --- 2. bench --csv ---------------------------------------------------------------------------


def test_bench_csv_is_left_alone_when_no_row_was_measured(work):
    (work / "rows.csv").write_text("my,own\n1,2\n")
    line = _refused([*HUGE_BENCH, "--shapes", HUGE_SHAPE, "--csv", "rows.csv", "--json"], work, "out of memory")
    assert "rows measured" not in line


def test_bench_csv_gets_the_rows_measured_before_running_out_of_memory(work):
    (work / "rows.csv").write_text("my,own\n1,2\n")
    before = snapshot(work)
    proc = run_clean([*HUGE_BENCH, "--shapes", f"48x40r4,{HUGE_SHAPE}", "--csv", "rows.csv"], work)
    assert proc.returncode == 2 and one_line(proc).endswith("; the 1 rows measured are in rows.csv")
    after = snapshot(work)
    assert set(after) == set(before) and {k for k in after if after[k] != before[k]} == {"rows.csv"}
    lines = (work / "rows.csv").read_text().splitlines()
    assert len(lines) == 2 and lines[0].startswith("device,") and ",48,40,4,1,fp32,infer," in lines[1]


@pytest.mark.parametrize("target,why", [("/dev/null", "not a regular file"), ("s", "is a folder")])
def test_bench_csv_refuses_what_is_not_a_regular_file(work, target, why):
    _refused([*HUGE_BENCH, "--shapes", "48x40r4", "--csv", target], work, "--csv", why)


# --- 3. Ctrl-C and a closed stdout in audit and sample -----------------------------------------


def test_audit_ctrl_c_is_exit_130_with_one_line(work):
    """The audit blocks reading --config from a FIFO; Ctrl-C arrives there, inside the command."""
    fifo = work / "config.fifo"
    os.mkfifo(fifo)
    before = snapshot(work)
    env = {**os.environ, "CI": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([*doracheck_command(), "audit", "s", "--config", str(fifo), *AUDIT], cwd=work,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    writer = None
    for _ in range(6000):  # the writer's open succeeds once the command has opened the FIFO to read it
        try:
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
    assert writer is not None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    os.close(writer)
    assert "Traceback" not in out + err
    assert proc.returncode == 130 and err == "doracheck audit: interrupted\n" and out == ""
    assert snapshot(work) == before


def _hook(folder: Path, action: str, at: str) -> dict:
    """An environment whose sitecustomize makes the command's open(..., "x...") of a file named
    ``at`` raise Ctrl-C (``action`` "interrupt") or fail with ENOSPC ("fail"): a deterministic
    point inside ``doracheck sample``'s writes."""
    (folder / "sitecustomize.py").write_text(
        "import builtins, errno, os, signal\n"
        "_open = builtins.open\n"
        "def _hooked(file, mode='r', *a, **k):\n"
        f"    if 'x' in mode and os.path.basename(str(file)) == {at!r}:\n"
        f"        if {action!r} == 'interrupt':\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "        else:\n"
        "            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))\n"
        "    return _open(file, mode, *a, **k)\n"
        "builtins.open = _hooked\n")
    return {"PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("action,code,message", [("interrupt", 130, "doracheck sample: interrupted"),
                                                 ("fail", 2, "cannot write the sample: No space left on device")])
def test_sample_cut_short_removes_what_it_made_and_nothing_else(tmp_path, action, code, message):
    hooks, cwd = tmp_path / "hooks", tmp_path / "cwd"
    hooks.mkdir()
    (cwd / "old").mkdir(parents=True)
    (cwd / "old" / "keep.txt").write_text("mine\n")
    env = _hook(hooks, action, "base_model.safetensors")  # the third file: two are written by then
    for target, left in (("new/deeper/s", {"old"}), ("old", {"old"})):
        proc = run_clean(["sample", target], cwd, env=env)
        assert proc.returncode == code and message in one_line(proc) and proc.stdout == ""
        assert {p.name for p in cwd.iterdir()} == left  # new/ and new/deeper/ were made by the run: gone
        assert [p.name for p in (cwd / "old").iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("args", [["sample", "out"], ["audit", "s", *AUDIT]], ids=["sample", "audit"])
def test_a_closed_stdout_is_a_quiet_exit_141(work, args):
    env = {**os.environ, "CI": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([*doracheck_command(), *args], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader left before the command printed anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and err == ""


# --- 4. "$" in a module name ------------------------------------------------------------------


def test_report_draws_module_names_with_dollar_signs_as_text(tmp_path):
    require_matplotlib()
    name = "model.layer$^^$.q_proj"  # mathtext would fail to parse this
    _adapter(tmp_path / "a", {name: SMALL})
    before = snapshot(tmp_path)
    proc = run_clean(["audit", "a", "--base", "a/base.safetensors", *AUDIT, "--report", "r.html"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "r.html").read_text()
    assert page.count("<svg") == 1 and page.count("layer$^^$") >= 3
    after = snapshot(tmp_path)
    assert set(after) - set(before) == {"r.html"} and all(after[k] == before[k] for k in before)


# --- 5. paths that cannot be read or written --------------------------------------------------


@pytest.mark.parametrize("args", [["audit", LONG], ["audit", "s", "--base", LONG], ["audit", "s", "--config", LONG],
                                  ["audit", f"{LONG}/x"], ["sample", f"{LONG}/x"],
                                  ["audit", "s", "--report", f"{LONG}.html"], ["verify", "--quick", "--report", f"{LONG}.html"]],
                         ids=["adapter", "base", "config", "below", "sample", "audit-report", "verify-report"])
def test_a_path_that_cannot_be_used_is_one_line(work, args):
    require_matplotlib()
    _refused([*args, *(AUDIT if args[0] == "audit" else [])], work, "File name too long")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads a folder without read permission")
def test_a_folder_without_permission_is_one_line(work):
    (work / "s").chmod(0)
    try:
        _refused(["audit", "s", *AUDIT], work, "Permission denied")
        _refused(["audit", "s/adapter_model.safetensors", *AUDIT], work, "Permission denied")
        _refused(["sample", "s/inner"], work, "Permission denied")
    finally:
        (work / "s").chmod(0o755)


# --- 6. out of host memory in bench --------------------------------------------------------------


def test_bench_out_of_host_memory_names_the_row(work):
    line = _refused([*HUGE_BENCH, "--shapes", HUGE_SHAPE, "--json"], work)  # --json: stdout stays empty
    assert line.startswith("doracheck bench: out of memory at 30000000x30000000 r4 T1 float32 infer on ")
    assert line.endswith("; try smaller --shapes or --tokens")


# --- 7.-10. odd adapters and bases --------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["a{99999999999}", "(" * 5000 + ")" * 5000], ids=["repeat", "nesting"])
def test_a_huge_repeat_count_in_a_config_pattern_is_one_line(work, pattern):
    config = json.loads((work / "s/adapter_config.json").read_text())
    config["rank_pattern"] = {pattern: 4}
    (work / "s/adapter_config.json").write_text(json.dumps(config))
    _refused(["audit", "s", *AUDIT], work, "rank_pattern pattern", "is not a valid regular expression")


def test_a_module_with_zero_output_features_is_a_shape_error(tmp_path):
    _adapter(tmp_path / "a", {"model.empty": ((8, 16), (0, 8), (0,), (0, 16)), "model.fine": SMALL})
    before = snapshot(tmp_path)
    proc = run_clean(["audit", "a", "--base", "a/base.safetensors", *AUDIT, "--json"], tmp_path)
    assert proc.returncode == 1 and proc.stderr == ""
    doc = {m["name"]: m for m in json.loads(proc.stdout)["modules"]}
    assert [c["id"] for c in doc["model.empty"]["checks"] if c["severity"] == "error"] == ["structure.shape"]
    assert "empty module" in doc["model.empty"]["checks"][0]["message"]
    assert not any(c["severity"] == "error" for c in doc["model.fine"]["checks"])
    assert snapshot(tmp_path) == before


def test_a_shard_index_that_is_not_utf8_is_one_line(work):
    shards = work / "shards"
    shards.mkdir()
    shutil.copy(work / "s/base_model.safetensors", shards / "model-00001-of-00001.safetensors")
    (shards / "model.safetensors.index.json").write_bytes(b'{"weight_map": {"\xff\xfe": 1}}')
    _refused(["audit", "s", "--base", "shards", *AUDIT], work, "model.safetensors.index.json: not a UTF-8 text file")


def test_module_names_with_non_ascii_digits_sort_without_a_crash(tmp_path):
    names = ["model.x²", "model.x10", "model.x2", "model.x٣"]
    _adapter(tmp_path / "a", {n: SMALL for n in names})
    proc = run_clean(["audit", "a", "--base", "a/base.safetensors", *AUDIT, "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [m["name"] for m in json.loads(proc.stdout)["modules"]] == ["model.x2", "model.x10", "model.x²", "model.x٣"]


# --- 11. fp64 base; 14. a folder named adapter_model.safetensors --------------------------------


def test_fp64_base_merge_error_is_counted_in_fp32_ulps(work):
    base = {k: v.double() for k, v in load_file(str(work / "s/base_model.safetensors")).items()}
    save_file(base, str(work / "s/base_model.safetensors"))
    proc = run_clean(["audit", "s", "--base", "s/base_model.safetensors", *AUDIT, "--json", "--strict"], work)
    assert proc.returncode == 0, proc.stdout[-2000:]
    for module in json.loads(proc.stdout)["modules"]:
        merge = next(c for c in module["checks"] if c["id"] == "merge.ulp")
        assert merge["severity"] == "info" and "ulps of float32" in merge["message"]
        assert module["merge_ulp"]["median"] < 8 and module["merge_ulp"]["max_vs_bound"] <= 1


def test_adapter_model_safetensors_that_is_a_folder_is_named_as_one(work):
    (work / "s/adapter_model.safetensors").rename(work / "s/adapter.safetensors")
    (work / "s/adapter_model.safetensors").mkdir()
    line = _refused(["audit", "s", *AUDIT], work, "adapter_model.safetensors: is a folder, not a file")
    assert "pass the adapter file itself" not in line
