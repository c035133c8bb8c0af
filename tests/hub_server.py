"""A local stand-in for the Hugging Face Hub's file API, for download tests without internet.

Speaks what huggingface_hub uses: `GET /api/models?search=…&limit=…&expand=…` (list_models:
ids containing the search, most downloaded first, with the `config` subset the Hub lists
(architectures, model_type), `safetensors` parameter counts read from the weights' headers,
`siblings` and `downloads`); `GET /api/models/{repo}[/revision/{rev}]` (model_info;
`?blobs=true` adds size, blobId and lfs {size, sha256, pointerSize}), `HEAD`/`GET
/{repo}/resolve/{rev}/{file}` with X-Repo-Commit, ETag, X-Linked-Etag, X-Linked-Size, and
for LFS files a 302 to a content URL that honours `Range` (206). Gated repos answer 401
(no token) or 403 (wrong token) with `X-Error-Code: GatedRepo`.

Faults, each applied once per file: `cut_after[file] = n` closes the connection after byte
n; `corrupt_once.add(file)` flips a byte; `stall_once[file] = (n, seconds)` goes silent
after byte n. Every request is logged in `server.log`.

Hostile servers (tests/test_hostile.py), applied to every response: `ignore_range` (a set
of files) answers every request with the whole file and status 200; `stall_every[file] =
(n, seconds)` goes silent after n bytes of each response, then closes it;
`midway[file] = (n, callback)` calls callback() once after byte n (to fill the disk; a callback
    that returns False drops the connection there). A
listing may name files that are not safe paths (`../../x`): the server lists them as given.

Other tests (the window's download page) can use the fixtures at the end:
`from hub_server import local_hub, registry_env  # noqa: F401` makes them available.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

LFS_SUFFIXES = (".safetensors", ".pt", ".bin")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubRepo:
    repo_id: str
    files: dict[str, bytes]
    gated: bool = False
    token: str | None = None  # the token that may read a gated repo
    claimed_sizes: dict[str, int] = field(default_factory=dict)  # LFS sizes announced, never served
    commit: str = ""
    downloads: int = 0  # the search's order: most downloaded first

    def __post_init__(self):
        if not self.commit:
            digest = hashlib.sha1(self.repo_id.encode())
            for name in sorted(self.files):
                digest.update(name.encode() + hashlib.sha256(self.files[name]).digest())
            self.commit = digest.hexdigest()

    def is_lfs(self, name: str) -> bool:
        return name.endswith(LFS_SUFFIXES) or name in self.claimed_sizes

    def size(self, name: str) -> int:
        return self.claimed_sizes.get(name, len(self.files.get(name, b"")))

    def sha256(self, name: str) -> str:
        return hashlib.sha256(self.files.get(name, b"")).hexdigest()

    def listed(self, expand: list[str]) -> dict:
        """The repo as the Hub's model list shows it, with the `expand`ed properties."""
        out = {"_id": self.commit[:24], "id": self.repo_id, "modelId": self.repo_id}
        if "config" in expand:
            try:
                config = json.loads(self.files.get("config.json", b"{}"))
            except ValueError:
                config = {}
            out["config"] = {k: config[k] for k in ("architectures", "model_type") if k in config}
        if "safetensors" in expand:
            params = safetensors_parameters(self.files)
            if params:
                out["safetensors"] = {"parameters": params, "total": sum(params.values())}
        if "siblings" in expand:
            out["siblings"] = [{"rfilename": n} for n in sorted(self.files)]
        if "downloads" in expand:
            out["downloads"] = self.downloads
        return out

    def sibling(self, name: str, blobs: bool) -> dict:
        out = {"rfilename": name}
        if blobs:
            data = self.files.get(name, b"")
            out["size"] = self.size(name)
            out["blobId"] = git_blob_sha1(data)
            if self.is_lfs(name):
                out["lfs"] = {"size": self.size(name), "sha256": self.sha256(name), "pointerSize": 134}
        return out


def safetensors_parameters(files: dict[str, bytes]) -> dict[str, int]:
    """Parameters per dtype in the repo's .safetensors files (their JSON headers), as the Hub
    counts them; files that are not safetensors (random test blobs) count nothing."""
    import struct

    counts: dict[str, int] = {}
    for name, data in files.items():
        if not name.endswith(".safetensors") or len(data) < 8:
            continue
        (n,) = struct.unpack("<Q", data[:8])
        try:
            header = json.loads(data[8:8 + n]) if n <= len(data) - 8 else {}
        except ValueError:
            continue
        for key, t in header.items():
            if key != "__metadata__" and isinstance(t, dict):
                size = 1
                for dim in t.get("shape", []):
                    size *= dim
                counts[t.get("dtype", "F32")] = counts.get(t.get("dtype", "F32"), 0) + size
    return counts


class HubServer:
    """Threaded HTTP server on 127.0.0.1 with a random port; use as a context manager."""

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.log: list[dict] = []
        self.cut_after: dict[str, int] = {}
        self.corrupt_once: set[str] = set()
        self.stall_once: dict[str, tuple[int, float]] = {}
        self.ignore_range: set[str] = set()
        self.stall_every: dict[str, tuple[int, float]] = {}
        self.midway: dict[str, tuple[int, object]] = {}
        self._lock = threading.Lock()
        # Two origins, as on the Hub: the API and /resolve/ on one, LFS content (the "CDN") on
        # another, so clients stop at the 302 for metadata and drop credentials on redirect.
        self._servers = []
        for _ in range(2):
            httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
            httpd.daemon_threads = True
            self._servers.append(httpd)
        self._threads = [threading.Thread(target=h.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
                         for h in self._servers]

    @staticmethod
    def _origin(httpd) -> str:
        host, port = httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def url(self) -> str:
        return self._origin(self._servers[0])

    @property
    def cdn_url(self) -> str:
        return self._origin(self._servers[1])

    def add_repo(self, repo: HubRepo) -> HubRepo:
        self.repos[repo.repo_id] = repo
        return repo

    def start(self) -> "HubServer":
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        for httpd, thread in zip(self._servers, self._threads):
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def record(self, entry: dict) -> None:
        with self._lock:
            self.log.append(entry)

    def requests(self, method: str | None = None, path_contains: str = "") -> list[dict]:
        with self._lock:
            return [e for e in self.log if (method is None or e["method"] == method)
                    and path_contains in e["path"]]

    def take_fault(self, table, name):
        with self._lock:
            if isinstance(table, set):
                if name in table:
                    table.discard(name)
                    return True
                return None
            return table.pop(name, None)


def _make_handler(server: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep test output quiet
            pass

        def do_HEAD(self):
            self._route(head=True)

        def do_GET(self):
            self._route(head=False)

        # -- routing ---------------------------------------------------------------
        def _route(self, head: bool):
            parts = urlsplit(self.path)
            path = unquote(parts.path)
            # Logged before any reply byte leaves, so a client never sees an answer the log lacks.
            self.entry = {"method": self.command, "path": path, "range": self.headers.get("Range"),
                          "auth": self.headers.get("Authorization"), "status": 0, "sent": 0}
            server.record(self.entry)
            try:
                if path.rstrip("/") == "/api/models":
                    self._list_models(parse_qs(parts.query))
                elif path.startswith("/api/models/"):
                    self._model_info(path[len("/api/models/"):], parse_qs(parts.query))
                elif path.startswith("/cdn/"):
                    self._cdn(path[len("/cdn/"):], head)
                elif "/resolve/" in path:
                    self._resolve(path.lstrip("/"), head)
                else:
                    self._error(404, "RepoNotFound", "no such endpoint")
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def _send_head(self, status: int, headers: dict):
            self.entry["status"] = status
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, str(value))
            self.end_headers()

        def _error(self, status: int, code: str, message: str, commit: str | None = None):
            body = json.dumps({"error": message}).encode()
            headers = {"Content-Type": "application/json", "Content-Length": len(body),
                       "X-Error-Code": code, "X-Error-Message": message}
            if commit:
                headers["X-Repo-Commit"] = commit
            self._send_head(status, headers)
            if self.command != "HEAD":
                self.wfile.write(body)

        def _repo_and_rest(self, path: str):
            org, _, rest = path.partition("/")
            name, _, rest = rest.partition("/")
            return server.repos.get(f"{org}/{name}"), f"{org}/{name}", rest

        def _auth_ok(self, repo: HubRepo) -> bool:
            if not repo.gated:
                return True
            auth = self.headers.get("Authorization")
            if not auth:
                self._error(401, "GatedRepo", "Access to model is restricted. You must be authenticated.")
                return False
            if auth != f"Bearer {repo.token}":
                self._error(403, "GatedRepo", "Access to model is restricted and you are not in the authorized list.")
                return False
            return True

        # -- endpoints -------------------------------------------------------------
        def _list_models(self, query: dict):
            search = (query.get("search") or [""])[0].lower()
            limit = int((query.get("limit") or ["1000"])[0])
            expand = query.get("expand") or query.get("expand[]") or []
            found = sorted((r for r in server.repos.values() if search in r.repo_id.lower()),
                           key=lambda r: (-r.downloads, r.repo_id))
            body = json.dumps([r.listed(expand) for r in found[:limit]]).encode()
            self._send_head(200, {"Content-Type": "application/json", "Content-Length": len(body)})
            self.entry["sent"] = len(body)
            self.wfile.write(body)

        def _model_info(self, rest: str, query: dict):
            repo, repo_id, tail = self._repo_and_rest(rest)
            if repo is None:
                return self._error(401, "RepoNotFound", "Repository not found")
            if tail and not (tail.startswith("revision/") and tail[len("revision/"):] in ("main", repo.commit)):
                return self._error(404, "RevisionNotFound", "Invalid rev id")
            blobs = query.get("blobs", ["false"])[0].lower() == "true"
            body = json.dumps({
                "id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                "gated": "manual" if repo.gated else False, "disabled": False, "tags": [],
                "siblings": [repo.sibling(n, blobs) for n in sorted(set(repo.files) | set(repo.claimed_sizes))],
            }).encode()
            self._send_head(200, {"Content-Type": "application/json", "Content-Length": len(body)})
            if self.command != "HEAD":
                self.entry["sent"] = len(body)
                self.wfile.write(body)

        def _resolve(self, path: str, head: bool):
            repo, repo_id, rest = self._repo_and_rest(path)
            if repo is None:
                return self._error(401, "RepoNotFound", "Repository not found")
            rev, _, filename = rest[len("resolve/"):].partition("/")
            if rev not in ("main", repo.commit):
                return self._error(404, "RevisionNotFound", "Invalid rev id")
            if filename not in repo.files and filename not in repo.claimed_sizes:
                return self._error(404, "EntryNotFound", "Entry not found", commit=repo.commit)
            if not self._auth_ok(repo):
                return
            common = {"X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes"}
            if repo.is_lfs(filename):
                sha = repo.sha256(filename)
                headers = dict(common, **{
                    "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": repo.size(filename),
                    "ETag": f'"{git_blob_sha1(repo.files.get(filename, b""))}"',
                    "Location": f"{server.cdn_url}/cdn/{repo_id}/{filename}", "Content-Length": 0})
                return self._send_head(302, headers)
            data = repo.files[filename]
            self._serve_bytes(repo, filename, data, dict(common, ETag=f'"{git_blob_sha1(data)}"'), head)

        def _cdn(self, path: str, head: bool):
            repo, _, filename = self._repo_and_rest(path)
            if repo is None or filename not in repo.files:
                return self._error(404, "EntryNotFound", "Entry not found")
            data = repo.files[filename]
            self._serve_bytes(repo, filename, data, {"ETag": f'"{repo.sha256(filename)}"',
                                                     "Accept-Ranges": "bytes"}, head)

        def _serve_bytes(self, repo: HubRepo, filename: str, data: bytes, headers: dict, head: bool):
            start, status = 0, 200
            rng = self.headers.get("Range")
            if filename in server.ignore_range:
                rng = None  # a server (or proxy) that does not do ranges: always the whole file
            if rng and rng.startswith("bytes="):
                first, _, last = rng[len("bytes="):].partition("-")
                start = int(first or 0)
                end = int(last) + 1 if last else len(data)
                if start >= len(data):
                    headers["Content-Range"] = f"bytes */{len(data)}"
                    return self._error(416, "RangeNotSatisfiable", "Range not satisfiable")
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
            else:
                end = len(data)
            body = data[start:end]
            headers["Content-Length"] = len(body)
            headers.setdefault("Content-Type", "application/octet-stream")
            self._send_head(status, headers)
            if head:
                return
            if server.take_fault(server.corrupt_once, filename):
                flip = len(body) // 2
                body = body[:flip] + bytes([body[flip] ^ 0xFF]) + body[flip + 1:]
            cut = server.take_fault(server.cut_after, filename)
            stall = server.take_fault(server.stall_once, filename) or server.stall_every.get(filename)
            hook = server.take_fault(server.midway, filename)
            if hook is not None:
                at = max(hook[0] - start, 0)
                self.wfile.write(body[:at])
                self.wfile.flush()
                if hook[1]() is False:  # the callback asks to drop the connection here
                    self.entry["sent"] = at
                    self.close_connection = True
                    return
                self.entry["sent"] = len(body)
                self.wfile.write(body[at:])
                return
            stop_at = None
            if cut is not None:
                stop_at = max(cut - start, 0)
            elif stall is not None:
                stop_at = max(stall[0] - start, 0)
            if stop_at is None:
                self.entry["sent"] = len(body)  # before writing: the client may finish first
                self.wfile.write(body)
                return
            self.entry["sent"] = stop_at
            self.wfile.write(body[:stop_at])
            self.wfile.flush()
            if stall is not None:
                import time

                time.sleep(stall[1])
            self.close_connection = True  # the client sees a body shorter than Content-Length

    return Handler


def tiny_llama_config(**overrides) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "relu",
        "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128,
        "max_position_embeddings": 256, "tie_word_embeddings": False,
    }
    config.update(overrides)
    return config


def tiny_model_files(weight_bytes: int = 300_000, seed: int = 0, **config_overrides) -> dict[str, bytes]:
    """Files of a small model repo: a config, tokenizer files and a safetensors-named blob."""
    import random

    rng = random.Random(seed)
    return {
        "config.json": json.dumps(tiny_llama_config(**config_overrides)).encode(),
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE"}}).encode(),
        "tokenizer_config.json": b'{"bos_token": "<s>"}',
        "model.safetensors": rng.randbytes(weight_bytes),
        "README.md": b"# tiny\n",
    }


@pytest.fixture
def registry_env(tmp_path, monkeypatch):
    """An empty models folder and config folder, no Hugging Face token, online."""
    monkeypatch.setenv("THERMOCLINE_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("THERMOCLINE_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no token from a real `hf auth login`
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "THERMOCLINE_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


@pytest.fixture
def local_hub(registry_env, monkeypatch):
    """A running HubServer with HF_ENDPOINT pointing at it; add repos with `add_repo`."""
    with HubServer() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server
