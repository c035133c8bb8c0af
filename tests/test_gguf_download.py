"""A catalogue entry whose weights are PowerInfer's Q4_0 GGUF (relullama-7b-q4), against the
local Hub: the one q4 file is fetched, imported with its 4-bit blocks kept, deleted, and the
model decodes as the same file imported by hand; a second download fetches nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

import gguf_factory as gf
import model_factory as mf
from app.cli import main
from engine import Engine, SamplingParams
from engine.loading.gguf_import import import_gguf
from engine.loading.weights import WeightSource
from hub_server import HubRepo, local_hub, registry_env  # noqa: F401
from models_registry.catalogue import get_entry

PROMPT = [0, 5, 9, 17, 33, 100, 7, 8]
REPO = "PowerInfer/ReluLLaMA-7B-PowerInfer-GGUF"


def test_catalogue_offers_the_q4_gguf_as_the_smaller_download():
    q4, fp32 = get_entry("relullama-7b-q4"), get_entry("relullama-7b")
    assert q4.repo == REPO and q4.gguf_weights and q4.files == ("*.q4.powerinfer.gguf",)
    assert q4.config == fp32.config and q4.size_bytes < fp32.size_bytes / 7
    assert not fp32.gguf_weights


def test_q4_gguf_repo_downloads_imports_and_decodes(local_hub, registry_env, tmp_path, capsys):
    hf = mf.llama_relu(tmp_path / "hf", dtype=torch.float16)
    g = np.random.default_rng(0)
    preds = ([g.standard_normal((32, 64)).astype(np.float32) for _ in range(2)],
             [g.standard_normal((160, 32)).astype(np.float32) for _ in range(2)])
    q4 = gf.write_gguf(hf, tmp_path / "llama-7b-relu.q4.powerinfer.gguf", qtype="Q4_0", predictors=preds,
                       sparse_threshold=0.0)
    f16 = gf.write_gguf(hf, tmp_path / "llama-7b-relu.powerinfer.gguf", qtype="F16", predictors=preds)
    local_hub.add_repo(HubRepo(REPO, {q4.name: q4.read_bytes(), f16.name: f16.read_bytes(), "README.md": b"# r\n"}))
    capsys.readouterr()

    assert main(["models", "download", "relullama-7b-q4", "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    model_dir = Path(result["model_dir"])
    # only the q4 file moved, and it is gone once imported
    assert local_hub.requests("GET", q4.name) and not local_hub.requests("GET", f16.name)
    assert not list(model_dir.glob("*.gguf")) and not (model_dir / "thermocline" / "gguf-import").exists()
    state = json.loads((model_dir / "thermocline" / "download.json").read_text())
    assert state["status"] == "ready" and state["weights_format"].startswith("gguf")
    assert state["predictors"] == "imported" and (model_dir / "thermocline" / "predictors.safetensors").is_file()
    source = WeightSource(model_dir)
    assert source.quant_kind("model.layers.1.mlp.up_proj.weight") == ("Q4_0", False)
    assert (model_dir / "model.safetensors").stat().st_size < 1.1 * q4.stat().st_size
    # it decodes as the same file imported by hand (the F32 path): same greedy ids
    ref_dir = tmp_path / "by-hand"
    import_gguf(q4, ref_dir, quantized=False)
    ref = Engine.load(ref_dir)
    ref.eos_ids = set()
    want = ref.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0)).token_ids
    got = Engine.load(model_dir)
    got.eos_ids = set()
    assert got.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0)).token_ids == want
    code = main(["generate", "--model", "relullama-7b-q4", "--prompt", "the quick fox", "--mode", "sparse",
                 "--cpu-weights", "int4", "--temperature", "0", "--max-new-tokens", "4", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["mode"] == "sparse"
    # a second download finds it ready and fetches nothing
    before = len(local_hub.requests("GET", q4.name))
    assert main(["models", "download", "relullama-7b-q4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["from_cache"] is True
    assert len(local_hub.requests("GET", q4.name)) == before


def test_disk_need_counts_the_import_written_next_to_the_gguf(local_hub, registry_env, tmp_path, capsys,
                                                              monkeypatch):
    """The import writes about the GGUF's tensor bytes (Q4_0 matrices and predictors, a Q6_K head,
    all kept as blocks) plus JSON: the disk check and the Models page's plan take the import's
    bytes from the GGUF's header (range requests), and refuse a disk that holds the GGUF but
    not its import."""
    from models_registry import download as dl

    hf = mf.llama_relu(tmp_path / "hf", hidden=256, ff=512, layers=2, dtype=torch.float16)
    g = np.random.default_rng(0)
    preds = ([g.standard_normal((64, 256)).astype(np.float32) for _ in range(2)],
             [g.standard_normal((512, 64)).astype(np.float32) for _ in range(2)])
    q4 = gf.write_gguf(hf, tmp_path / "llama-7b-relu.q4.powerinfer.gguf", qtype="Q4_0", predictors=preds,
                       sparse_threshold=0.0, q6_k=("output.weight",))
    local_hub.add_repo(HubRepo(REPO, {q4.name: q4.read_bytes(), "README.md": b"# r\n"}))
    plan = dl.planned_disk("relullama-7b-q4")
    assert plan["bytes"] == q4.stat().st_size
    assert all(r["range"] for r in local_hub.requests("GET", q4.name))  # the header only
    by_hand = tmp_path / "by-hand"
    import_gguf(q4, by_hand)
    written = sum(p.stat().st_size for p in by_hand.rglob("*") if p.is_file())
    tensor_bytes = sum(p.stat().st_size for p in by_hand.rglob("*.safetensors"))
    assert 0.7 * q4.stat().st_size < tensor_bytes < 1.1 * q4.stat().st_size  # blocks as in the GGUF
    assert written <= plan["model_bytes"] <= written + 4 * q4.stat().st_size  # exact tensors + a JSON bound
    assert plan["disk_need"] >= q4.stat().st_size + written
    # a disk with room for the GGUF twice over, not for its import: refused before a byte moves
    monkeypatch.setattr(dl, "free_disk", lambda path: (path, 2 * q4.stat().st_size + dl.DISK_MARGIN_MIN))
    assert main(["models", "download", "relullama-7b-q4", "--json"]) == 2
    assert "not enough free disk" in capsys.readouterr().err
    assert all(r["range"] for r in local_hub.requests("GET", q4.name))


def test_a_refused_import_keeps_the_gguf_and_a_retry_completes(local_hub, registry_env, tmp_path, capsys):
    """The import runs under the download lock and after the GGUF is verified: when it refuses the
    file (predictors of one layer of two), the GGUF and the record stay, a retry imports the kept
    file again without fetching it, and once the Hub serves a good file (another hash) the retry
    fetches that one and completes."""
    from models_registry.download import download_model
    from models_registry.gguf_weights import import_weights_gguf
    from models_registry.state import read_state

    hf = mf.llama_relu(tmp_path / "hf", dtype=torch.float16)
    g = np.random.default_rng(0)
    fc1 = [g.standard_normal((32, 64)).astype(np.float32) for _ in range(2)]
    fc2 = [g.standard_normal((160, 32)).astype(np.float32) for _ in range(2)]
    name = "llama-7b-relu.q4.powerinfer.gguf"
    (tmp_path / "bad").mkdir()
    (tmp_path / "good").mkdir()
    bad = gf.write_gguf(hf, tmp_path / "bad" / name, qtype="Q4_0", predictors=(fc1[:1], fc2[:1]))
    local_hub.add_repo(HubRepo(REPO, {name: bad.read_bytes(), "README.md": b"# r\n"}))
    capsys.readouterr()
    assert main(["models", "download", "relullama-7b-q4"]) == 2
    err = capsys.readouterr().err
    assert [ln for ln in err.splitlines() if ln.startswith("error: ")] == [
        f"error: {name} has predictors for layers [0] only"] and "Traceback" not in err
    model_dir = next(p.parent.parent for p in (registry_env / "models").glob("**/thermocline/download.json"))
    assert (model_dir / name).read_bytes() == bad.read_bytes()
    state = read_state(model_dir)
    assert state["files"][name]["verified"] and not state.get("converted")
    assert not (model_dir / "thermocline" / "gguf-import").exists()
    assert not (model_dir / "thermocline" / "download.lock").exists()
    fetched = len([r for r in local_hub.requests("GET", name) if not r["range"]])
    # the same file again: imported from disk (refused again), not fetched
    assert main(["models", "download", "relullama-7b-q4"]) == 2
    capsys.readouterr()
    assert len([r for r in local_hub.requests("GET", name) if not r["range"]]) == fetched
    assert (model_dir / name).is_file()
    # the Hub's file fixed in a new commit: a partial download stays on its pinned commit, so the
    # retry names the new one; it fetches the new GGUF (another hash) and imports it, locked
    good = gf.write_gguf(hf, tmp_path / "good" / name, qtype="Q4_0", predictors=(fc1, fc2))
    local_hub.add_repo(HubRepo(REPO, {name: good.read_bytes(), "README.md": b"# r\n"}))
    locked_while_importing = []

    def progress(event):
        if event.kind == "convert":
            locked_while_importing.append((model_dir / "thermocline" / "download.lock").exists())

    assert download_model("relullama-7b-q4", revision="main", progress=progress).model_dir == model_dir
    assert locked_while_importing == [True]
    assert len([r for r in local_hub.requests("GET", name) if not r["range"]]) == fetched + 1
    state = read_state(model_dir)
    assert state["status"] == "ready" and state["converted"] == {name: "model.safetensors"}
    assert not (model_dir / name).exists() and (model_dir / "thermocline" / "predictors.safetensors").is_file()

    # the record is written before the GGUF goes: a crash in between still names the import
    gone = []
    src = tmp_path / "again" / name
    src.parent.mkdir()
    src.write_bytes(good.read_bytes())
    import_weights_gguf(src.parent, {}, name, "relu",
                        save_state=lambda: gone.append(not src.exists()))
    assert gone == [False] and not src.exists()
