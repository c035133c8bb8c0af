"""The demo model's corpus preparation and training script, on a small slice, in seconds."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from safetensors import safe_open

import model_factory
from engine import Engine, SamplingParams
from tools.demo_model import data, prepare_corpus

REPO = Path(__file__).resolve().parent.parent


def xdr_character_vector(lines: list[str | None]) -> bytes:
    """R's serialisation (format 3, XDR) of a character vector; None is NA."""
    out = b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500)
    out += struct.pack(">i", 5) + b"UTF-8"
    out += struct.pack(">ii", 16, len(lines))
    for line in lines:
        if line is None:
            out += struct.pack(">ii", 9, -1)
        else:
            raw = line.encode("utf-8")
            out += struct.pack(">ii", 0x00040009, len(raw)) + raw
    return out


def rdb(records: list[bytes]) -> bytes:
    return b"".join(struct.pack(">I", len(r)) + zlib.compress(r) for r in records)


def test_prepare_corpus_reads_r_lazy_load_data(tmp_path):
    novel_a = ["CHAPTER I", "", "It was a _fine_ day, and the", "rain had stopped.", "", None,
               '"Good morning," said she.', "", '"And to you."', ""]
    novel_b = ["Persuasion é", "", "Sir Walter", "Elliot."]
    blob = rdb([xdr_character_vector(novel_a), xdr_character_vector(novel_b)])
    records = prepare_corpus.read_rdb_records(blob)
    assert [prepare_corpus.parse_character_vector(r) for r in records] == [
        [line if line is not None else "" for line in novel_a], novel_b]
    assert prepare_corpus.paragraphs(novel_a[:5] + [""]) == [
        "CHAPTER I", "It was a fine day, and the rain had stopped."]

    (tmp_path / "Rdata.rdb").write_bytes(blob)
    prepare_corpus.main(["--rdb", str(tmp_path / "Rdata.rdb"), "--out", str(tmp_path / "out"),
                         "--heldout-fraction", "0.25"])
    train = (tmp_path / "out" / "train.txt").read_text(encoding="utf-8").splitlines()
    heldout = (tmp_path / "out" / "heldout.txt").read_text(encoding="utf-8").splitlines()
    assert train == ["CHAPTER I", "It was a fine day, and the rain had stopped.", '"Good morning," said she.',
                     "Persuasion é"]
    assert heldout == ['"And to you."', "Sir Walter Elliot."]
    with pytest.raises(ValueError):
        prepare_corpus.read_rdb_records(struct.pack(">I", 99) + zlib.compress(b"short"))


def test_dialogue_pairs_use_the_chat_turns():
    paras = ['"How do you do?"', '"Very well, I thank you."', "She smiled.", '"Is it so," said he, "truly?"']
    assert data.dialogue_pairs(paras) == ["User: How do you do?\nAssistant: Very well, I thank you."]


@pytest.fixture()
def corpus(tmp_path) -> Path:
    rng = random.Random(0)
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, lines in (("train.txt", 120), ("heldout.txt", 20)):
        paras = []
        for i in range(lines):
            sentence = " ".join(rng.choice(model_factory.WORDS) for _ in range(14)).capitalize() + "."
            paras.append(f'"{sentence}"' if i % 3 else sentence)
        (folder / name).write_text("\n".join(paras) + "\n", encoding="utf-8")
    return folder


def run_training(corpus: Path, work: Path, out: Path, steps: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tools.demo_model.train", "--corpus", str(corpus), "--work", str(work),
           "--out", str(out), "--max-chars", "20000", "--vocab-size", "300", "--hidden", "32", "--ffn", "64",
           "--layers", "2", "--heads", "2", "--kv-heads", "1", "--ctx", "64", "--seq-len", "32",
           "--batch", "2", "--steps", str(steps), "--warmup", "1", "--eval-every", "2",
           "--checkpoint-every", "2", "--sparsity-start", "0.0", "--dtype", "float32"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_training_script_exports_a_loadable_model_and_resumes(corpus, tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    first = run_training(corpus, work, out, steps=4)
    assert "resuming at step 0" in first.stdout
    assert "sample: " in first.stdout and "heldout ppl" in first.stdout

    config = json.loads((out / "config.json").read_text())
    assert config["hidden_act"] == "relu" and config["num_hidden_layers"] == 2
    assert config["tie_word_embeddings"] is True
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file(), name
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["bos_token"] == "<s>" and "Assistant:" in tok_config["chat_template"]
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 4 and 0.0 <= summary["heldout_gate_sparsity"] <= 1.0

    # Checkpoints are safetensors + JSON, never pickles.
    with safe_open(str(work / "checkpoint.safetensors"), "pt") as f:
        assert any(k.startswith("opt.exp_avg.") for k in f.keys())
    assert json.loads((work / "checkpoint.json").read_text())["step"] == 4

    engine = Engine.load(out, ctx=64)
    result = engine.generate("The old man", SamplingParams(max_new_tokens=5, temperature=0))
    assert 0 < len(result.token_ids) <= 5
    chat = engine.tokenizer.render_chat([{"role": "user", "content": "Hello"}])
    assert chat == "<s>User: Hello\nAssistant:"

    second = run_training(corpus, work, out, steps=6)
    assert "resuming at step 4" in second.stdout
    assert json.loads((out / "training_summary.json").read_text())["steps"] == 6
