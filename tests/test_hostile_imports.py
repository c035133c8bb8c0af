"""Imports that try to reach outside their source, and imports cut short (issue 28).

Each case runs the real `thermocline models import` in its own process (a link to /dev/zero
or a FIFO could hang it; the hang guard fails the test instead). A link out of the folder,
a FIFO or a device is refused with one `error:` line naming it; nothing outside the source
is ever hard-linked into the models folder; a kill -9 or a leftover of an older version is
never listed as ready, and the next import replaces it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hostile_cases import DEMO, REPO, Sandbox, demo_copy
from test_hostile_files import tmpfs  # noqa: F401

pytestmark = pytest.mark.timeout(600)


def _model(tmp_path: Path) -> Path:
    return demo_copy(tmp_path / "outside" / "model", weights="copy")


def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "secret" / "passwords.txt"  # outside the sandbox's writable folders
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_text("root:x:0:0\n")
    return secret


def _inodes(folder: Path) -> set[tuple[int, int]]:
    return {(p.stat().st_dev, p.stat().st_ino) for p in folder.rglob("*") if p.is_file()}


def _nothing_imported(tmp_path: Path) -> None:
    assert [p.name for p in (tmp_path / "models").iterdir()] == []


@pytest.mark.parametrize("name, target", [
    ("tokenizer.json", "secret"), ("model.safetensors", "secret"), ("tokenizer.json", "/etc/passwd"),
    ("model.safetensors", "/etc/passwd"), ("tokenizer.json", "/dev/zero"), ("config.json", "/dev/zero"),
    ("extra/notes.txt", "secret"),
])
def test_a_link_out_of_the_folder_is_refused_naming_it(tmp_path, name, target):
    model = _model(tmp_path)
    point_at = _secret(tmp_path) if target == "secret" else Path(target)
    link = model / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(point_at)
    box = Sandbox(tmp_path)
    out = box.run("models", "import", str(model), "--name", "evil")
    line = out.assert_clean_error(Path(name).name, "outside the folder")
    assert len(line) < 600
    _nothing_imported(tmp_path)
    assert box.stray_files() == []


def test_a_link_to_a_folder_outside_is_refused(tmp_path):
    model = _model(tmp_path)
    (model / "extra").symlink_to(_secret(tmp_path).parent, target_is_directory=True)
    box = Sandbox(tmp_path)
    box.run("models", "import", str(model), "--name", "evil").assert_clean_error("extra", "link to a folder")
    _nothing_imported(tmp_path)


@pytest.mark.parametrize("kind", ["fifo", "fifo-config"])
def test_a_fifo_is_refused_not_read(tmp_path, kind):
    model = _model(tmp_path)
    name = "config.json" if kind == "fifo-config" else "tokenizer.json"
    (model / name).unlink()
    os.mkfifo(model / name)
    box = Sandbox(tmp_path)
    box.run("models", "import", str(model), "--name", "pipe").assert_clean_error(name, "not a regular file")
    _nothing_imported(tmp_path)


def test_a_hard_link_to_a_file_outside_is_copied_not_shared(tmp_path):
    """A file in the folder that is also a name elsewhere: the import must not share that inode."""
    model = _model(tmp_path)
    secret = _secret(tmp_path)
    os.link(secret, model / "notes.txt")
    box = Sandbox(tmp_path)
    box.run("models", "import", str(model), "--name", "mine").assert_ok()
    target = tmp_path / "models" / "local--mine"
    assert (target / "notes.txt").read_text() == secret.read_text()
    assert (secret.stat().st_dev, secret.stat().st_ino) not in _inodes(target)
    (target / "notes.txt").write_text("edited")  # an edit in the models folder leaves the original alone
    assert secret.read_text() == "root:x:0:0\n"


def test_links_inside_the_folder_are_followed(tmp_path):
    model = _model(tmp_path)
    (model / "real").mkdir()
    (model / "tokenizer.json").rename(model / "real" / "tok.json")
    (model / "tokenizer.json").symlink_to(Path("real") / "tok.json")
    box = Sandbox(tmp_path)
    box.run("models", "import", str(model), "--name", "inside").assert_ok()
    imported = tmp_path / "models" / "local--inside" / "tokenizer.json"
    assert not imported.is_symlink() and imported.read_bytes() == (model / "real" / "tok.json").read_bytes()


def test_an_import_larger_than_the_free_disk_is_refused_before_copying(tmp_path, tmpfs):
    """The models folder is on another filesystem (a small tmpfs): every file is a copy."""
    disk = tmpfs(tmp_path / "models", "8m")
    box = Sandbox(tmp_path)
    box.run("models", "import", str(_model(tmp_path)), "--name", "big").assert_clean_error("not enough free disk")
    assert [p.name for p in disk.iterdir()] == []


def test_a_file_or_missing_path_is_named_for_what_it_is(tmp_path):
    box = Sandbox(tmp_path)
    text = tmp_path / "outside" / "notes.txt"
    text.write_text("hello")
    box.run("models", "import", str(tmp_path / "outside")).assert_clean_error("no config.json")
    box.run("models", "import", str(tmp_path / "outside" / "nope")).assert_clean_error("does not exist")
    gguf_folder = tmp_path / "outside" / "x.gguf"
    gguf_folder.mkdir()
    box.run("models", "import", str(gguf_folder)).assert_clean_error("is a folder, not a .gguf file")


# -- interrupted imports ------------------------------------------------------------------------
def _models_list(box: Sandbox) -> dict:
    out = box.run("models", "list", "--json")
    out.assert_ok()
    return {m["id"]: m for m in json.loads(out.stdout)["models"]}


def _demo_gguf(tmp_path: Path) -> Path:
    import gguf_factory as gf

    (tmp_path / "outside").mkdir(exist_ok=True)
    return gf.write_gguf(DEMO, tmp_path / "outside" / "demo.gguf", qtype="F16", powerinfer=False)


def test_a_half_gguf_import_left_by_an_older_version_is_damaged_and_replaced(tmp_path):
    """What the issue found after a kill -9: local--NAME with a cut model.safetensors, no state."""
    gguf_path = _demo_gguf(tmp_path)
    half = tmp_path / "models" / "local--demo"
    half.mkdir(parents=True)
    (half / "config.json").write_text((DEMO / "config.json").read_text())
    (half / "model.safetensors").write_bytes((DEMO / "model.safetensors").read_bytes()[:2_000_000])
    stale = tmp_path / "models" / ".import-999999999-abc"  # a hidden folder of a process long gone
    (stale / "model").mkdir(parents=True)
    box = Sandbox(tmp_path)
    listed = _models_list(box)
    assert listed["local/demo"]["status"] == "damaged"
    assert not any(".import" in key for key in listed)
    box.run("models", "import", str(gguf_path), "--activation", "relu").assert_ok()
    assert _models_list(box)["local/demo"]["status"] == "ready"
    assert not stale.exists()
    box.run("generate", "--model", "local/demo", "--prompt", "Hello", "--max-new-tokens", "2").assert_ok()


def test_kill_9_during_a_gguf_import_is_never_listed_ready_and_the_rerun_works(tmp_path):
    gguf_path = _demo_gguf(tmp_path)
    box = Sandbox(tmp_path)
    models = tmp_path / "models"
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "models", "import", str(gguf_path),
                             "--activation", "relu"], cwd=REPO,
                            env=box.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if any(p.name == "model.safetensors" for p in models.glob(".import-*/model/*")):
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the import finished before it could be killed"
    listed = _models_list(box)
    assert "local/demo" not in listed or listed["local/demo"]["status"] != "ready"
    box.run("models", "import", str(gguf_path), "--activation", "relu").assert_ok()
    assert _models_list(box)["local/demo"]["status"] == "ready"
    assert not list(models.glob(".import-*"))
    assert box.stray_files() == []


# -- GGUF files that lie about what they are ------------------------------------------------------
def test_a_gguf_of_another_architecture_is_named_so(tmp_path):
    import gguf_factory as gf

    (tmp_path / "outside").mkdir(exist_ok=True)
    path = gf.write_gguf(DEMO, tmp_path / "outside" / "bert.gguf", qtype="F16", powerinfer=False, arch="bert")
    box = Sandbox(tmp_path)
    box.run("models", "import", str(path)).assert_clean_error("not a GGUF of a supported architecture", "bert")
    _nothing_imported(tmp_path)


def test_a_gguf_whose_architecture_string_claims_2_to_the_63_bytes(tmp_path):
    """The issue found it called "a None model"."""
    import struct

    data = bytearray(_demo_gguf(tmp_path).read_bytes())
    key = b"general.architecture"
    at = data.index(key) + len(key)
    assert struct.unpack_from("<I", data, at)[0] == 8  # a string value follows: u64 length, bytes
    struct.pack_into("<Q", data, at + 4, 1 << 63)
    path = tmp_path / "outside" / "huge-string.gguf"
    path.write_bytes(bytes(data))
    box = Sandbox(tmp_path)
    line = box.run("models", "import", str(path), mem_gib=4).assert_clean_error("huge-string.gguf")
    assert "None" not in line and len(line) < 600
    _nothing_imported(tmp_path)


@pytest.mark.parametrize("what", ["file", "gguf"])
def test_a_file_given_as_a_model_is_called_a_file(tmp_path, what):
    box = Sandbox(tmp_path)
    path = tmp_path / "outside" / ("notes.txt" if what == "file" else "model.gguf")
    path.write_text("hello")
    out = box.run("generate", "--model", str(path), "--prompt", "Hi", "--max-new-tokens", "1")
    line = out.assert_clean_error("is a file, not a folder")
    assert "does not exist" not in line
    if what == "gguf":
        assert "models import" in line
