"""The command line: JSON contract and one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import main

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_generate_json_has_the_contract_fields(llama_dir):
    proc = run_cli("generate", "--model", str(llama_dir), "--prompt", "the quick", "--max-new-tokens", "5",
                   "--temperature", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("text", "token_ids", "prompt_tokens", "new_tokens", "ttft_s", "prefill_tok_s", "decode_tok_s",
                "mode", "ffn_active_fraction", "hot_hit_fraction", "vram_bytes", "ram_bytes"):
        assert key in report
    assert report["mode"] == "dense" and report["ram_bytes"] > 0


def _broken_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _assert_one_line_error(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert needle in err[0]


def test_missing_config(capsys, tmp_path, llama_dir):
    model = _broken_copy(llama_dir, tmp_path / "m")
    (model / "config.json").unlink()
    _assert_one_line_error(capsys, ["generate", "--model", str(model), "--prompt", "x"], "no config.json")


def test_truncated_safetensors(capsys, tmp_path, llama_dir):
    model = _broken_copy(llama_dir, tmp_path / "m")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    _assert_one_line_error(capsys, ["generate", "--model", str(model), "--prompt", "x"], "truncated")


def test_mismatched_tensor_shapes(capsys, tmp_path, llama_dir):
    model = _broken_copy(llama_dir, tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (model / "config.json").write_text(json.dumps(cfg))
    _assert_one_line_error(capsys, ["generate", "--model", str(model), "--prompt", "x"], "shape")


@pytest.mark.parametrize("change, needle", [
    ({"model_type": "gpt2"}, "unknown model_type"),
    ({"hidden_act": "gelu"}, "not sparse"),
])
def test_unsupported_architectures(capsys, tmp_path, llama_dir, change, needle):
    model = _broken_copy(llama_dir, tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(change)
    (model / "config.json").write_text(json.dumps(cfg))
    _assert_one_line_error(capsys, ["generate", "--model", str(model), "--prompt", "x"], needle)


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--prompt", "x", "--vram-budget", "lots"], "cannot read size"),
    (["generate", "--prompt", "x", "--nonsense"], "unrecognized arguments"),
])
def test_bad_usage(capsys, argv, needle):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0]


def test_real_process_prints_no_traceback(tmp_path):
    proc = run_cli("generate", "--model", str(tmp_path / "nowhere"), "--prompt", "x")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_an_unknown_kv_cache_format_is_one_line(capsys, monkeypatch, llama_dir):
    monkeypatch.setenv("THERMOCLINE_KV_CACHE", "fp8")
    _assert_one_line_error(capsys, ["generate", "--model", str(llama_dir), "--prompt", "x"], "THERMOCLINE_KV_CACHE")
