"""`thermocline models ...` and `thermocline hw` through the real CLI entry point."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from hub_server import HubRepo, local_hub, registry_env, tiny_llama_config, tiny_model_files  # noqa: F401
from models_registry.resolve import resolve_model
from models_registry.state import read_state

MODEL_REPO, PRED_REPO = "SparseLLM/ReluLLaMA-7B", "PowerInfer/ReluLLaMA-7B-Predictor"


@pytest.fixture
def env(registry_env):
    return registry_env


@pytest.fixture
def hub(local_hub):
    return local_hub


def _predictor_files(config: dict, rank: int = 8) -> dict[str, bytes]:
    """Real PowerInfer-format predictor checkpoints (state dicts saved by torch)."""
    import io

    import torch

    files = {}
    gen = torch.Generator().manual_seed(0)
    for layer in range(config["num_hidden_layers"]):
        state = {"fc1.weight": torch.randn(rank, config["hidden_size"], generator=gen),
                 "fc2.weight": torch.randn(config["intermediate_size"], rank, generator=gen)}
        buf = io.BytesIO()
        torch.save(state, buf)
        files[f"model_{layer}.pt"] = buf.getvalue()
    return files


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_hw_json_reports_memory_cpu_gpus_and_disk(env, capsys):
    code, out, _ = _run(capsys, "hw", "--json")
    hw = json.loads(out)
    assert code == 0
    assert 0 < hw["ram_available"] <= hw["ram_total"]
    assert hw["cpu_logical_cores"] >= 1 and isinstance(hw["simd"], list)
    assert isinstance(hw["gpus"], list) and (hw["gpus"] or hw["gpu_note"])
    assert hw["disk_path"] == str(env / "models") and hw["disk_free"] > 0
    code, out, _ = _run(capsys, "hw")
    assert code == 0 and "RAM" in out and "GPU" in out


def test_download_list_remove_a_catalogue_model(hub, env, capsys):
    hub.add_repo(HubRepo(MODEL_REPO, tiny_model_files()))
    hub.add_repo(HubRepo(PRED_REPO, _predictor_files(tiny_llama_config())))
    code, out, err = _run(capsys, "models", "download", "relullama-7b", "--json")
    assert code == 0, err
    result = json.loads(out)
    model_dir = env / "models" / "SparseLLM--ReluLLaMA-7B"
    assert result["model_dir"] == str(model_dir) and resolve_model("relullama-7b") == model_dir
    assert "done:" in err  # progress went to stderr
    try:
        from engine.loading.predictor_import import import_powerinfer_predictors  # noqa: F401
    except ImportError:  # the engine's importer is not there yet: the step is skipped loudly
        assert result["predictors"] == "downloaded" and "not imported" in err
    else:
        assert result["predictors"] == "imported"
        assert (model_dir / "thermocline" / "predictors.safetensors").is_file()
        code, out, _ = _run(capsys, "models", "fit", "relullama-7b", "--vram-budget", "0", "--ram-budget", "1GiB",
                            "--json")
        config = tiny_llama_config()  # the fit now reads the downloaded config and the real predictor ranks
        rank8 = 8 * (config["hidden_size"] + config["intermediate_size"])
        scales = (8 + config["intermediate_size"]) * 4  # int8 rows of fc1 and fc2, an fp32 scale each
        assert json.loads(out)["predictor_cpu_bytes"] == config["num_hidden_layers"] * (rank8 + scales)

    code, out, _ = _run(capsys, "models", "list", "--json")
    listing = {m["id"]: m for m in json.loads(out)["models"]}
    assert listing["relullama-7b"]["status"] == "ready" and listing["relullama-7b"]["bytes_on_disk"] > 0
    assert listing["relullama-13b"]["status"] == "not downloaded"
    assert listing["relullama-13b"]["fit"]["verdict"] in {"fits", "fits with cold neurons on CPU", "runs from disk", "does not fit"}

    code, out, _ = _run(capsys, "models", "verify", "relullama-7b", "--json")
    assert code == 0 and json.loads(out)["damaged"] == []
    with open(model_dir / "model.safetensors", "r+b") as f:
        f.write(b"\0\0\0\0")
    code, out, _ = _run(capsys, "models", "verify", "relullama-7b")
    assert code == 1 and "model.safetensors" in out and "models download relullama-7b" in out

    code, out, _ = _run(capsys, "models", "remove", "relullama-7b", "--json")
    assert code == 0 and json.loads(out)["bytes_freed"] > 0 and not model_dir.exists()
    code, _, err = _run(capsys, "models", "remove", "relullama-7b")
    assert code == 2 and err.startswith("error:") and "nothing to remove" in err


def test_cli_errors_are_one_line_with_exit_code_2(hub, env, capsys):
    hub.add_repo(HubRepo("tiny/gated", tiny_model_files(), gated=True, token="hf_ok"))
    code, _, err = _run(capsys, "models", "download", "tiny/gated")
    assert code == 2 and err.startswith("error: tiny/gated is a gated repo") and len(err.splitlines()) == 1
    code, _, err = _run(capsys, "models", "download", "no-such-thing")
    assert code == 2 and "catalogue id" in err
    code, _, err = _run(capsys, "models", "download", "demo")
    assert code == 2 and "ships with Thermocline" in err
    code, _, err = _run(capsys, "models", "download", "tiny/gated", "--offline")
    assert code == 2 and "offline mode" in err


def test_import_a_local_folder(env, capsys, tmp_path):
    src = tmp_path / "my-relu"
    src.mkdir()
    for name, data in tiny_model_files().items():
        (src / name).write_bytes(data)
    code, out, err = _run(capsys, "models", "import", str(src), "--name", "mine", "--json")
    assert code == 0, err
    target = resolve_model("local/mine")
    assert json.loads(out) == {"id": "local/mine", "path": str(target)}
    assert (target / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert read_state(target)["origin"] == str(src.resolve())
    code, out, _ = _run(capsys, "models", "list", "--json")
    assert any(m["id"] == "local/mine" and m["status"] == "ready" for m in json.loads(out)["models"])

    code, _, err = _run(capsys, "models", "import", str(src), "--name", "mine")
    assert code == 2 and "already exists" in err
    (src / "config.json").write_text(json.dumps(tiny_llama_config(hidden_act="gelu")))
    code, _, err = _run(capsys, "models", "import", str(src), "--name", "other")
    assert code == 2 and "not sparse: Thermocline needs a ReLU-family model" in err


def test_fit_command_before_download(env, capsys):
    code, out, _ = _run(capsys, "models", "fit", "relullama-7b", "--vram-budget", "0", "--ram-budget", "64GiB",
                        "--json")
    est = json.loads(out)
    assert code == 0 and est["verdict"] == "fits with cold neurons on CPU" and est["vram_bytes"] == 0
    code, out, _ = _run(capsys, "models", "fit", "relullama-7b", "--vram-budget", "16GiB", "--ram-budget", "1GiB",
                        "--json")
    assert json.loads(out)["verdict"] == "fits"
    code, out, _ = _run(capsys, "models", "fit", "relullama-70b", "--vram-budget", "0", "--ram-budget", "8GiB")
    assert code == 0 and "does not fit" in out
    code, _, err = _run(capsys, "models", "fit", "relullama-7b", "--ctx", "0")
    assert code == 2 and "--ctx" in err
    # 4-bit CPU rows: about half the RAM of int8 rows for the same (CPU-only) placement
    ram = {}
    for fmt in ("int4", "int8"):
        code, out, _ = _run(capsys, "models", "fit", "relullama-7b", "--vram-budget", "0", "--ram-budget", "64GiB",
                            "--cpu-weights", fmt, "--ctx", "256", "--json")
        ram[fmt] = json.loads(out)["ram_bytes"]
    assert 0.5 < ram["int4"] / ram["int8"] < 0.7


def test_list_includes_models_added_by_hand(env, tmp_path):
    from models_registry.manage import list_models

    folder = tmp_path / "in-place"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_llama_config()))
    listing = {m.id: m for m in list_models(extra=[str(folder), "someone/later", "relullama-7b"])}
    assert listing[str(folder)].status == "local"
    assert listing["someone/later"].status == "not downloaded"
    assert sum(1 for key in listing if key in ("relullama-7b", "SparseLLM/ReluLLaMA-7B")) == 1  # no duplicate
