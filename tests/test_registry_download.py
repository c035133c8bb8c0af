"""Downloads over real HTTP from a local Hub stand-in (tests/hub_server.py); no internet."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest

from engine.errors import UserError
from hub_server import HubRepo, local_hub, registry_env, tiny_model_files  # noqa: F401
from models_registry.resolve import resolve_model
from models_registry.download import IntegrityError, download_model, verify_model
from models_registry.progress import DownloadCancelled, DownloadControl
from models_registry.state import read_state
from models_registry.transfer import TransferError

REPO = "tiny/relu-llama"
WEIGHTS = "model.safetensors"


@pytest.fixture
def env(registry_env):
    return registry_env


@pytest.fixture
def hub(local_hub):
    return local_hub


def _get(server, filename):
    return [e for e in server.requests("GET") if e["path"].endswith("/" + filename)]


def _collect():
    events = []
    return events, events.append


def test_progress_events_sum_to_each_file_and_the_total(hub, env):
    files = tiny_model_files(weight_bytes=2_500_000)
    files["special_tokens_map.json"] = b""  # an empty file is a file too
    hub.add_repo(HubRepo(REPO, files))
    events, on_event = _collect()
    result = download_model(REPO, progress=on_event, retry_delay=0)

    model_dir = env / "models" / "tiny--relu-llama"
    assert result.model_dir == model_dir and resolve_model(REPO) == model_dir
    wanted = {"config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", WEIGHTS}
    assert set(result.files) == wanted
    for name in wanted:
        assert (model_dir / name).read_bytes() == files[name]
        starts = [e for e in events if e.kind == "file_start" and e.filename == name]
        deltas = sum(e.delta for e in events if e.kind == "progress" and e.filename == name)
        assert starts[-1].resumed_from + deltas == len(files[name])
    total = sum(len(files[n]) for n in wanted)
    assert events[-1].kind == "done" and events[-1].done == events[-1].total == total
    assert result.bytes_fetched == total
    progress = [e for e in events if e.kind == "progress"]
    assert all(e.total == total and 0 < e.done <= total for e in progress)
    assert [e.done for e in progress] == sorted(e.done for e in progress)
    assert read_state(model_dir)["status"] == "ready"
    assert read_state(model_dir)["revision"] == hub.repos[REPO].commit  # pinned to the commit


def test_transfer_cut_mid_file_resumes_where_it_stopped(hub, env):
    files = hub.add_repo(HubRepo(REPO, tiny_model_files(weight_bytes=600_000))).files
    hub.cut_after[WEIGHTS] = 250_000
    events, on_event = _collect()
    download_model(REPO, progress=on_event, retry_delay=0)

    gets = _get(hub, WEIGHTS)
    cdn = [g for g in gets if g["path"].startswith("/cdn/")]
    assert [g["range"] for g in cdn] == [None, "bytes=250000-"]
    assert sum(g["sent"] for g in cdn) == len(files[WEIGHTS])  # not one byte fetched twice
    assert any(e.kind == "retry" and e.filename == WEIGHTS for e in events)
    model_dir = resolve_model(REPO)
    assert (model_dir / WEIGHTS).read_bytes() == files[WEIGHTS]


def test_crash_keeps_partial_file_and_next_run_continues_it(hub, env):
    files = hub.add_repo(HubRepo(REPO, tiny_model_files(weight_bytes=600_000))).files
    hub.cut_after[WEIGHTS] = 200_000

    def crash_when_cut(event):  # the process dies (Ctrl-C) right after the cut
        if event.kind == "retry":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        download_model(REPO, progress=crash_when_cut, retry_delay=0)
    with pytest.raises(UserError, match="not downloaded"):
        resolve_model(REPO)

    events, on_event = _collect()
    result = download_model(REPO, progress=on_event, retry_delay=0)
    start = [e for e in events if e.kind == "file_start" and e.filename == WEIGHTS][-1]
    assert start.resumed_from == 200_000
    assert _get(hub, WEIGHTS)[-1]["range"] == "bytes=200000-"
    # config.json was verified before the crash; the weights continue at byte 200000
    assert result.bytes_fetched == result.bytes_total - len(files["config.json"]) - 200_000
    assert (result.model_dir / WEIGHTS).read_bytes() == files[WEIGHTS]


def test_cancel_keeps_partial_and_pause_resume_completes(hub, env):
    files = hub.add_repo(HubRepo(REPO, tiny_model_files(weight_bytes=4_000_000))).files
    control = DownloadControl()

    def cancel_on_first_weight_bytes(event):
        if event.kind == "progress" and event.filename == WEIGHTS:
            control.cancel()

    with pytest.raises(DownloadCancelled):
        download_model(REPO, progress=cancel_on_first_weight_bytes, control=control)
    part = env / "models" / "tiny--relu-llama" / "thermocline" / "partial" / (WEIGHTS + ".part")
    kept = part.stat().st_size
    assert 0 < kept < len(files[WEIGHTS])

    control = DownloadControl()
    events = []

    def pause_once(event):
        events.append(event)
        if event.kind == "progress" and event.filename == WEIGHTS and not any(e.kind == "paused" for e in events):
            control.pause()
            threading.Timer(0.2, control.resume).start()

    result = download_model(REPO, progress=pause_once, control=control)
    kinds = [e.kind for e in events]
    assert kinds.index("paused") < kinds.index("resumed") < kinds.index("done")
    ranges = [g["range"] for g in _get(hub, WEIGHTS) if g["path"].startswith("/cdn/")]
    assert ranges[1] == f"bytes={kept}-" and len(ranges) == 3  # resumed after cancel, then after pause
    assert (result.model_dir / WEIGHTS).read_bytes() == files[WEIGHTS]


def test_a_pause_during_a_retry_wait_is_reported(hub, env):
    """Pausing while a cut transfer waits to retry says so (and says when it resumes), with
    the bytes kept so far, like a pause mid-stream."""
    files = hub.add_repo(HubRepo(REPO, tiny_model_files(weight_bytes=600_000))).files
    hub.cut_after[WEIGHTS] = 250_000
    control = DownloadControl()
    events = []

    def pause_on_retry(event):
        events.append(event)
        if event.kind == "retry" and event.filename == WEIGHTS:
            control.pause()
            threading.Timer(0.2, control.resume).start()

    result = download_model(REPO, progress=pause_on_retry, control=control, retry_delay=0)
    kinds = [e.kind for e in events]
    assert kinds.index("retry") < kinds.index("paused") < kinds.index("resumed") < kinds.index("done")
    paused = events[kinds.index("paused")]
    assert (paused.filename, paused.file_done) == (WEIGHTS, 250_000)
    assert (result.model_dir / WEIGHTS).read_bytes() == files[WEIGHTS]


def test_a_server_that_keeps_failing_gives_up_and_keeps_the_partial_file(hub, env):
    hub.add_repo(HubRepo(REPO, tiny_model_files(weight_bytes=300_000)))
    hub.cut_after[WEIGHTS] = 0  # the first transfer sends nothing
    with pytest.raises(TransferError, match="failed 1 times in a row"):
        download_model(REPO, max_retries=0, retry_delay=0)
    assert read_state(env / "models" / "tiny--relu-llama")["status"] == "downloading"


def test_stalled_transfer_is_retried_from_where_it_stalled(hub, env):
    files = hub.add_repo(HubRepo(REPO, tiny_model_files(weight_bytes=300_000))).files
    hub.stall_once[WEIGHTS] = (120_000, 2.0)
    events, on_event = _collect()
    result = download_model(REPO, progress=on_event, stall_timeout=0.5, retry_delay=0)
    assert any(e.kind == "retry" and e.filename == WEIGHTS for e in events)
    assert _get(hub, WEIGHTS)[-1]["range"] == "bytes=120000-"
    assert (result.model_dir / WEIGHTS).read_bytes() == files[WEIGHTS]


def test_corrupted_file_is_reported_and_fetched_again(hub, env):
    files = hub.add_repo(HubRepo(REPO, tiny_model_files())).files
    hub.corrupt_once.add(WEIGHTS)
    events, on_event = _collect()
    result = download_model(REPO, progress=on_event, retry_delay=0)
    corrupt = [e for e in events if e.kind == "corrupt"]
    assert [e.filename for e in corrupt] == [WEIGHTS] and "fetching it again" in corrupt[0].message
    assert result.corrupt_refetched == [WEIGHTS]
    assert len([g for g in _get(hub, WEIGHTS) if g["path"].startswith("/cdn/")]) == 2
    assert (result.model_dir / WEIGHTS).read_bytes() == files[WEIGHTS]
    assert events[-1].done == events[-1].total


def test_file_corrupted_twice_stops_without_marking_ready(hub, env):
    hub.add_repo(HubRepo(REPO, tiny_model_files()))
    hub.corrupt_once.add(WEIGHTS)

    def corrupt_again(event):
        if event.kind == "corrupt":
            hub.corrupt_once.add(WEIGHTS)

    with pytest.raises(IntegrityError, match="damaged twice"):
        download_model(REPO, progress=corrupt_again, retry_delay=0)
    model_dir = env / "models" / "tiny--relu-llama"
    assert read_state(model_dir)["status"] == "downloading"
    assert not (model_dir / WEIGHTS).exists()


def test_damaged_file_on_disk_is_found_and_refetched(hub, env):
    files = hub.add_repo(HubRepo(REPO, tiny_model_files())).files
    model_dir = download_model(REPO, retry_delay=0).model_dir
    damaged = bytearray(files[WEIGHTS])
    damaged[10] ^= 1
    (model_dir / WEIGHTS).write_bytes(bytes(damaged))
    assert verify_model(model_dir) == [WEIGHTS]
    with pytest.raises(UserError, match="not downloaded"):
        resolve_model(REPO)
    events, on_event = _collect()
    result = download_model(REPO, progress=on_event, retry_delay=0)
    assert [e.filename for e in events if e.kind == "corrupt"] == [WEIGHTS]
    assert (model_dir / WEIGHTS).read_bytes() == files[WEIGHTS]
    assert result.bytes_fetched == len(files[WEIGHTS])


def test_not_enough_disk_is_refused_before_any_transfer(hub, env):
    files = tiny_model_files()
    hub.add_repo(HubRepo(REPO, files, claimed_sizes={"model-00002-of-00002.safetensors": 10**16}))
    with pytest.raises(UserError, match="not enough free disk"):
        download_model(REPO)
    assert not [e for e in hub.requests("GET") if "/resolve/" in e["path"] or "/cdn/" in e["path"]]


def test_offline_mode_uses_the_downloaded_copy_and_refuses_the_rest(hub, env, monkeypatch):
    hub.add_repo(HubRepo(REPO, tiny_model_files()))
    first = download_model(REPO, retry_delay=0)
    before = len(hub.log)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = download_model(REPO)
    assert again.from_cache and again.model_dir == first.model_dir and len(hub.log) == before
    assert resolve_model(REPO) == first.model_dir
    with pytest.raises(UserError, match="offline mode: other/model is not downloaded"):
        download_model("other/model")
    assert len(hub.log) == before


def test_gated_repo_needs_a_token(hub, env):
    hub.add_repo(HubRepo(REPO, tiny_model_files(), gated=True, token="hf_right"))
    with pytest.raises(UserError, match="gated repo; no Hugging Face token is set"):
        download_model(REPO)
    assert not hub.requests("GET", "/resolve/")  # refused after one HEAD, before any transfer
    assert hub.requests("HEAD", "/resolve/")[-1]["status"] == 401
    with pytest.raises(UserError, match="gated repo; your token has no access"):
        download_model(REPO, token="hf_wrong")
    result = download_model(REPO, token="hf_right", retry_delay=0)
    assert read_state(result.model_dir)["status"] == "ready"
    resolves = [e for e in hub.requests("GET", "/resolve/") if e["status"] in (200, 302)]
    assert resolves and all(e["auth"] == "Bearer hf_right" for e in resolves)
    assert all(e["auth"] is None for e in hub.requests("GET", "/cdn/"))  # not sent to the CDN


def test_saved_token_is_used(hub, env):
    from models_registry.token import get_token, save_token, token_path

    hub.add_repo(HubRepo(REPO, tiny_model_files(), gated=True, token="hf_saved"))
    save_token("hf_saved")
    assert get_token() == "hf_saved" and (token_path().stat().st_mode & 0o777) == 0o600
    download_model(REPO, retry_delay=0)


def test_unsupported_architecture_is_refused_before_the_weights(hub, env):
    hub.add_repo(HubRepo("tiny/gelu-llama", tiny_model_files(hidden_act="gelu")))
    with pytest.raises(UserError, match="not sparse: Thermocline needs a ReLU-family model"):
        download_model("tiny/gelu-llama")
    assert not _get(hub, WEIGHTS)
    assert not (env / "models" / "tiny--gelu-llama").exists()


def test_catalogue_model_downloads_its_predictors_and_hands_them_over(hub, env):
    entry_repo, pred_repo = "SparseLLM/ReluLLaMA-7B", "PowerInfer/ReluLLaMA-7B-Predictor"
    hub.add_repo(HubRepo(entry_repo, tiny_model_files()))
    pred_files = {f"model_{i}.pt": hashlib.sha256(bytes([i])).digest() * 100 for i in (0, 1, 10)}
    pred_files["README.md"] = b"predictors"
    hub.add_repo(HubRepo(pred_repo, pred_files))
    calls = []

    def importer(src, dst):  # stands in for engine.predictors.import_powerinfer_predictors
        calls.append((src, dst, sorted(p.name for p in src.iterdir())))
        (dst / "thermocline" / "predictors.safetensors").write_bytes(b"imported")

    result = download_model("relullama-7b", on_predictors_downloaded=importer, retry_delay=0)
    src = result.model_dir / "thermocline" / "powerinfer-predictor"
    assert calls == [(src, result.model_dir, ["model_0.pt", "model_1.pt", "model_10.pt"])]
    assert not src.exists()  # imported, so the .pt copies are gone
    state = read_state(result.model_dir)
    assert state["predictors"] == "imported" and state["predictor"]["revision"] == hub.repos[pred_repo].commit
    assert not [rel for rel in state["files"] if "powerinfer-predictor" in rel]
    assert resolve_model("relullama-7b") == result.model_dir
    again = download_model("relullama-7b", on_predictors_downloaded=importer)
    assert again.from_cache and len(calls) == 1  # nothing fetched or imported twice


def test_failed_import_is_retried_by_the_next_download(hub, env):
    hub.add_repo(HubRepo("SparseLLM/ReluLLaMA-7B", tiny_model_files()))
    hub.add_repo(HubRepo("PowerInfer/ReluLLaMA-7B-Predictor", {"model_0.pt": b"x" * 1000}))

    def broken(src, dst):
        raise UserError("cannot load model_0.pt safely")

    with pytest.raises(UserError, match="safely"):
        download_model("relullama-7b", on_predictors_downloaded=broken, retry_delay=0)
    state = read_state(env / "models" / "SparseLLM--ReluLLaMA-7B")
    assert state["status"] == "ready" and state["predictors"] == "downloaded"  # dense modes work meanwhile
    gets = len(hub.requests("GET", "/cdn/"))
    imported = []
    download_model("relullama-7b", on_predictors_downloaded=lambda src, dst: imported.append(src), retry_delay=0)
    assert imported and len(hub.requests("GET", "/cdn/")) == gets  # verified files were not fetched again


def test_pickled_weights_only_when_there_are_no_safetensors(hub, env):
    both = tiny_model_files()
    both["pytorch_model.bin"] = b"pickle" * 100
    hub.add_repo(HubRepo(REPO, both))
    result = download_model(REPO, retry_delay=0)
    assert WEIGHTS in result.files and "pytorch_model.bin" not in result.files
    assert read_state(result.model_dir)["weights_format"] == "safetensors"

    # Pickles alone are fetched, then converted (tests/test_checkpoint_convert.py has more);
    # bytes that are no plain state dict are refused and nothing of the model is kept.
    only_bin = tiny_model_files()
    only_bin["pytorch_model.bin"] = only_bin.pop(WEIGHTS)
    hub.add_repo(HubRepo("tiny/old-format", only_bin))
    with pytest.raises(UserError, match="pytorch_model.bin was refused"):
        download_model("tiny/old-format", retry_delay=0)
    assert not (env / "models" / "tiny--old-format").exists()
    assert any("pytorch_model.bin" in r["path"] for r in hub.requests("GET"))


def test_local_server_speaks_what_huggingface_hub_expects(hub, env):
    from huggingface_hub import hf_hub_download

    files = hub.add_repo(HubRepo(REPO, tiny_model_files())).files
    for name in ("config.json", WEIGHTS):
        path = hf_hub_download(REPO, name, endpoint=hub.url, cache_dir=str(env / "hf_cache"))
        with open(path, "rb") as f:
            assert f.read() == files[name]
    assert json.loads(files["config.json"])["hidden_act"] == "relu"


def test_offline_setting_is_remembered(hub, env):
    from models_registry.paths import set_offline

    set_offline(True)
    with pytest.raises(UserError, match="offline mode"):
        download_model(REPO)
    set_offline(False)
    hub.add_repo(HubRepo(REPO, tiny_model_files()))
    assert download_model(REPO, retry_delay=0).files


def test_a_new_commit_discards_partial_files_of_the_old_one(hub, env):
    hub.add_repo(HubRepo(REPO, tiny_model_files(weight_bytes=300_000, seed=1)))
    hub.cut_after[WEIGHTS] = 100_000

    def crash_when_cut(event):
        if event.kind == "retry":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        download_model(REPO, progress=crash_when_cut, retry_delay=0)
    new = hub.add_repo(HubRepo(REPO, tiny_model_files(weight_bytes=300_000, seed=2)))  # the repo moved on
    events, on_event = _collect()
    result = download_model(REPO, revision=new.commit, progress=on_event, retry_delay=0)
    assert not [e for e in events if e.kind == "corrupt"]  # no stale prefix was taken for damage
    assert (result.model_dir / WEIGHTS).read_bytes() == new.files[WEIGHTS]
    assert read_state(result.model_dir)["revision"] == new.commit


def test_one_download_per_model_at_a_time(hub, env):
    import subprocess
    import sys

    files = hub.add_repo(HubRepo(REPO, tiny_model_files(weight_bytes=2_000_000))).files
    control = DownloadControl()
    errors = []

    def start_second_while_first_runs(event):
        if event.kind == "progress" and event.filename == WEIGHTS and not errors:
            try:
                download_model(REPO)
            except UserError as exc:
                errors.append(str(exc))

    download_model(REPO, progress=start_second_while_first_runs, control=control, retry_delay=0)
    assert errors and "already being downloaded in this window" in errors[0]
    assert (env / "models" / "tiny--relu-llama" / WEIGHTS).read_bytes() == files[WEIGHTS]
    assert not (env / "models" / "tiny--relu-llama" / "thermocline" / "download.lock").exists()

    # A lock left by another live process is respected; one left by a dead process is taken over.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        hub.add_repo(HubRepo("tiny/second", tiny_model_files()))
        lock = env / "models" / "tiny--second" / "thermocline" / "download.lock"
        lock.parent.mkdir(parents=True)
        lock.write_text(str(other.pid))
        with pytest.raises(UserError, match=f"already being downloaded by process {other.pid}"):
            download_model("tiny/second")
    finally:
        other.kill()
        other.wait()
    assert download_model("tiny/second", retry_delay=0).files  # the owner is gone now


def test_the_download_size_comes_from_the_hubs_listing_before_any_transfer(hub, env):
    from models_registry.download import planned_disk

    files = tiny_model_files(weight_bytes=123_456)
    hub.add_repo(HubRepo(REPO, files))
    expected = sum(len(v) for k, v in files.items() if k != "README.md")
    assert planned_disk(REPO)["bytes"] == expected
    assert not hub.requests("GET", "/resolve/")  # the listing only: no file was fetched
    seen = []

    def progress(ev):
        if ev.kind == "plan":  # the state file already says how big the model is
            seen.append(read_state(env / "models" / REPO.replace("/", "--"))["size_bytes"])

    download_model(REPO, progress=progress, retry_delay=0)
    assert seen == [expected]


def test_the_catalogues_activation_is_recorded_in_the_folder_for_the_engine(hub, env):
    """An old Falcon config.json names no activation: the download records the catalogue's
    in the model's folder, where the engine reads it (it asks the registry nothing); a
    download recorded before that gets it when the name is resolved."""
    from engine.arch import read_config
    from engine.errors import ModelFormatError
    from models_registry.state import write_state

    falcon = {"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
              "vocab_size": 300, "new_decoder_architecture": True, "num_kv_heads": 2}
    files = tiny_model_files()
    files["config.json"] = json.dumps(falcon).encode()
    hub.add_repo(HubRepo("SparseLLM/ReluFalcon-40B", files))
    result = download_model("relufalcon-40b", with_predictors=False, retry_delay=0)
    state = read_state(result.model_dir)
    assert state["activation"] == "relu"
    assert read_config(result.model_dir).activation == "relu"
    del state["activation"]  # as a download made before the record carried it
    write_state(result.model_dir, state)
    with pytest.raises(ModelFormatError, match="not sparse"):  # Falcon's default, GELU: nothing else says relu
        read_config(result.model_dir)
    assert resolve_model("relufalcon-40b") == result.model_dir
    assert read_state(result.model_dir)["activation"] == "relu"
    assert read_config(result.model_dir).activation == "relu"
