"""Checking a repo or folder the user adds, before downloading its weights."""

from __future__ import annotations

import json

import pytest

from engine.errors import UserError
from hub_server import HubRepo, local_hub, registry_env, tiny_llama_config, tiny_model_files  # noqa: F401
from models_registry.hardware import HardwareInfo
from models_registry.repo_check import check_folder, check_repo


@pytest.fixture
def hub(local_hub):
    return local_hub


def test_a_supported_repo_is_described_from_its_config_alone(hub):
    files = hub.add_repo(HubRepo("someone/relu-mistral", tiny_model_files(model_type="mistral"))).files
    machine = HardwareInfo(ram_total=16 << 30, ram_available=16 << 30, cpu_model="cpu", cpu_physical_cores=4,
                           cpu_logical_cores=8, simd=[])
    check = check_repo("someone/relu-mistral", hardware=machine)
    assert (check.arch.family, check.arch.activation) == ("llama", "relu")
    assert check.size_bytes == sum(len(files[n]) for n in ("config.json", "model.safetensors", "tokenizer.json",
                                                            "tokenizer_config.json"))
    assert check.fit["verdict"] == "fits with cold neurons on CPU"
    assert not [e for e in hub.requests("GET") if e["path"].endswith("model.safetensors")]


def test_an_unsupported_repo_is_refused_by_name(hub):
    hub.add_repo(HubRepo("someone/gelu", tiny_model_files(hidden_act="gelu")))
    with pytest.raises(UserError, match="not sparse.*supported: .*Llama with ReLU"):
        check_repo("someone/gelu")
    with pytest.raises(UserError, match="not found"):
        check_repo("someone/missing")


def test_a_local_folder_is_checked(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_llama_config(model_type="falcon", hidden_act=None,
                                                                       activation="relu")))
    assert check_folder(folder).arch.family == "falcon"
    with pytest.raises(UserError, match="no config.json"):
        check_folder(tmp_path / "nothing")
