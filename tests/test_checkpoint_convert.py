"""PyTorch-pickle checkpoints: converted to safetensors on import and after a download;
a pickle that would run code is refused, runs nothing and leaves nothing behind."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from app.cli import main
from engine.loading.checkpoint_convert import convert_pytorch_checkpoint, safetensors_name
from engine.errors import UnsafePickleError, UserError
from hub_server import HubRepo, local_hub, registry_env  # noqa: F401
from model_factory import llama_relu
from models_registry.state import read_state


def _as_pickles(folder: Path, shards: int = 2) -> dict[str, torch.Tensor]:
    """Replace a folder's safetensors by `pytorch_model-0000N-of-0000M.bin` shards + index,
    the layout of SparseLLM/ReluFalcon-40B; returns the original tensors."""
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = {n: tensors[n] for n in names[i::shards]}
        fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save(part, folder / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


class _CreatesFile:
    """Unpickling this calls open(path, "w"): a file appears if the pickle is ever run."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def _hostile_bin(path: Path, victim: Path, zip_format: bool = True) -> None:
    state = {"model.embed_tokens.weight": torch.zeros(4, 4), "payload": _CreatesFile(victim)}
    if zip_format:
        torch.save(state, path)
    else:
        path.write_bytes(pickle.dumps(state, protocol=2))


def _greedy(model_dir: Path, prompt: str = "the quick brown", n: int = 8) -> list[int]:
    from engine.runtime.engine import Engine
    from engine.runtime.sampling import SamplingParams

    engine = Engine.load(model_dir, mode="dense")
    ids = [ev.token_id for ev in engine.stream(prompt, SamplingParams(temperature=0.0, max_new_tokens=n))]
    return ids


def test_names_of_converted_shards():
    assert safetensors_name("pytorch_model.bin") == "model.safetensors"
    assert safetensors_name("pytorch_model-00003-of-00018.bin") == "model-00003-of-00018.safetensors"


def test_bin_only_model_imports_and_decodes_like_the_safetensors_original(registry_env, tmp_path, capsys):
    original = llama_relu(tmp_path / "orig")
    expected = _greedy(original)
    folder = llama_relu(tmp_path / "binonly")
    tensors = _as_pickles(folder)
    assert not list(folder.glob("*.safetensors"))

    code = main(["models", "import", str(folder), "--name", "binonly", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    target = Path(json.loads(out)["path"])
    assert sorted(p.name for p in target.glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not list(target.glob("pytorch_model*"))  # pickles and their index are gone from the copy
    assert sorted(p.name for p in folder.glob("pytorch_model*")) == [  # the user's own files stay
        "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json"]
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    for name, ref in tensors.items():
        got = load_file(str(target / index["weight_map"][name]))[name]
        assert got.dtype == ref.dtype and torch.equal(got, ref)
    state = read_state(target)
    assert state["status"] == "ready" and "converted" in state["weights_format"]
    assert set(state["files"]) >= {"model-00001-of-00002.safetensors", "model.safetensors.index.json"}
    assert not any(rel.endswith(".bin") for rel in state["files"])

    assert _greedy(target) == expected


@pytest.mark.parametrize("zip_format", [True, False], ids=["torch-zip", "raw-pickle"])
def test_a_bin_that_would_create_a_file_is_refused_and_creates_nothing(registry_env, tmp_path, capsys, zip_format):
    folder = llama_relu(tmp_path / "hostile")
    (folder / "model.safetensors").unlink()
    victim = tmp_path / "pwned.txt"
    _hostile_bin(folder / "pytorch_model.bin", victim, zip_format)
    capsys.readouterr()

    code = main(["models", "import", str(folder), "--name", "hostile"])
    out, err = capsys.readouterr()
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "refused" in lines[0], err
    assert "Traceback" not in err
    assert not victim.exists()  # nothing ran
    models = registry_env / "models"
    assert not (models / "local--hostile").exists()  # nothing of it was kept
    assert (folder / "pytorch_model.bin").is_file()  # the user's file is not ours to delete


def test_converter_refuses_before_writing_anything(tmp_path):
    folder = llama_relu(tmp_path / "m")
    _as_pickles(folder, shards=2)
    victim = tmp_path / "pwned.txt"
    _hostile_bin(folder / "pytorch_model-00002-of-00002.bin", victim)
    with pytest.raises(UnsafePickleError):
        convert_pytorch_checkpoint(folder)
    assert not victim.exists()
    assert not list(folder.glob("*.safetensors*")) and not list(folder.glob("pytorch_model*"))


def test_conversion_checks_the_disk_first_and_keeps_the_pickles(tmp_path):
    folder = llama_relu(tmp_path / "m")
    _as_pickles(folder, shards=2)
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(UserError, match="not enough free disk"):
        convert_pytorch_checkpoint(folder, free_disk=lambda _path: 1000)
    assert sorted(p.name for p in folder.iterdir()) == before


def test_a_rerun_after_a_crash_finishes_the_conversion(tmp_path):
    folder = llama_relu(tmp_path / "m")
    tensors = _as_pickles(folder, shards=2)
    # An earlier run converted shard 1 (renamed after its check) and died before deleting its pickle.
    part = torch.load(folder / "pytorch_model-00001-of-00002.bin", weights_only=True)
    from engine.loading.checkpoint_convert import write_safetensors

    write_safetensors(part, folder / "model-00001-of-00002.safetensors")
    result = convert_pytorch_checkpoint(folder)
    assert result["converted"] == {"pytorch_model-00002-of-00002.bin": "model-00002-of-00002.safetensors"}
    assert not list(folder.glob("*.bin"))
    merged = {}
    for f in folder.glob("*.safetensors"):
        merged.update(load_file(str(f)))
    assert set(merged) == set(tensors) and all(torch.equal(merged[k], tensors[k]) for k in tensors)


def _repo_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_download_of_a_pickle_only_repo_arrives_as_safetensors(local_hub, registry_env, tmp_path, capsys):
    folder = llama_relu(tmp_path / "src")
    _as_pickles(folder, shards=2)
    local_hub.add_repo(HubRepo("someone/pickled-relu", _repo_files(folder)))
    code = main(["models", "download", "someone/pickled-relu", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    target = Path(json.loads(out)["model_dir"])
    assert not list(target.glob("*.bin")) and (target / "model.safetensors.index.json").is_file()
    state = read_state(target)
    assert state["status"] == "ready" and "converted" in state["weights_format"]
    assert _greedy(target) == _greedy(llama_relu(tmp_path / "orig"))
    # The second call finds it ready (the recorded files are the converted ones).
    code = main(["models", "download", "someone/pickled-relu", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0 and json.loads(out)["from_cache"] is True


def test_download_of_a_hostile_pickle_keeps_nothing(local_hub, registry_env, tmp_path, capsys):
    folder = llama_relu(tmp_path / "src")
    (folder / "model.safetensors").unlink()
    victim = tmp_path / "pwned.txt"
    _hostile_bin(folder / "pytorch_model.bin", victim)
    local_hub.add_repo(HubRepo("someone/hostile", _repo_files(folder)))
    capsys.readouterr()
    code = main(["models", "download", "someone/hostile"])
    _, err = capsys.readouterr()
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    assert "Unsupported global: GLOBAL io.open" in errors[0] and "Traceback" not in err
    assert not victim.exists()
    assert not (registry_env / "models" / "someone--hostile").exists()


def test_registry_converts_in_a_child_process_when_no_converter_is_given(registry_env, tmp_path):
    from models_registry.manage import import_model

    folder = llama_relu(tmp_path / "m")
    tensors = _as_pickles(folder, shards=1)
    (folder / "pytorch_model-00001-of-00001.bin").rename(folder / "pytorch_model.bin")
    (folder / "pytorch_model.bin.index.json").unlink()
    target = import_model(folder, "child")
    got = load_file(str(target / "model.safetensors"))
    assert set(got) == set(tensors)
    victim = tmp_path / "pwned.txt"
    _hostile_bin(folder / "pytorch_model.bin", victim)
    with pytest.raises(UnsafePickleError, match="refused"):
        import_model(folder, "child2")
    assert not victim.exists() and not (registry_env / "models" / "local--child2").exists()
