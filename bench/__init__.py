"""Benchmarks: each module runs with `python -m bench.<name>` and prints one JSON object as
its last line. They measure speed; the test suite checks behaviour, never wall time."""

import os

# As the engine does (engine/__init__.py): torch's spinning OpenMP workers would otherwise
# steal the cores from the numba kernels. Set here so it precedes every benchmark's torch import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def emit(result: dict, json_only: bool) -> None:
    """A readable table unless --json, then the result as one JSON object on the last line."""
    import json

    if not json_only:
        for key, value in result.items():
            print(f"{key:28s} {value}")
    print(json.dumps(result))


def llama_cpp_missing() -> str | None:
    """Why llama.cpp's side of a benchmark cannot run here, or None when llama-cpp-python imports."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama-cpp-python is not installed ({e}); pip install -e '.[bench]'"
    return None


def peak_rss() -> int:
    """This process's peak resident set, bytes: /proc's VmHWM, its own memory's high-water mark.
    Not getrusage's ru_maxrss, which on Linux keeps the peak of the process before it exec'd (a
    worker spawned by a parent that had just built a 2.6 GB model reported 2.6 GB whatever it
    loaded); that only where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    import sys

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def add_placeholder_vocab(writer, vocab: int) -> None:
    """An SPM vocabulary of `vocab` tokens llama.cpp loads, on a gguf.GGUFWriter: the benchmarks'
    prompts are token ids, so the pieces are placeholders."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    tokens += [f"\u2581t{i}" for i in range(vocab - len(tokens))]
    types += [gguf.TokenType.NORMAL] * (vocab - len(types))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(vocab)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
