"""One file over HTTP: resumable (Range), hashed while it streams, retried when it stalls.

The partial file is `<name>.part`; bytes already in it are hashed again and the transfer
continues from its end, so a cancelled or crashed download never starts over. A stream
that stops delivering for `stall_timeout` seconds, or that the server cuts, is retried from
where it stopped, up to `max_retries` times in a row without progress.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from engine.errors import UserError

from .hub import RemoteFile
from .progress import DownloadControl, ProgressMeter

CHUNK = 1 << 20


class TransferError(UserError):
    """A file could not be fetched after all retries."""


class RangeIgnoredError(TransferError):
    """The server keeps answering a resume with the whole file and never finishes it."""


MAX_RESTARTS = 3  # times a server that ignores Range may send us back to byte 0


class Hasher:
    """sha256 of the content (LFS files) or git's blob sha1 (regular files)."""

    def __init__(self, kind: str, size: int) -> None:
        self.kind = kind
        if kind == "sha256":
            self._h = hashlib.sha256()
        else:
            self._h = hashlib.sha1()
            self._h.update(b"blob %d\0" % size)

    def update(self, data: bytes) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def hash_file(path: Path, kind: str, size: int, upto: int | None = None) -> Hasher:
    hasher = Hasher(kind, size)
    left = path.stat().st_size if upto is None else upto
    with open(path, "rb") as f:
        while left > 0:
            block = f.read(min(CHUNK * 8, left))
            if not block:
                break
            hasher.update(block)
            left -= len(block)
    return hasher


def _retryable(exc: Exception) -> bool:
    import httpx2
    from huggingface_hub import errors

    if isinstance(exc, (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError)):
        return True
    if isinstance(exc, errors.HfHubHTTPError) and exc.response is not None:
        return exc.response.status_code in (408, 429) or exc.response.status_code >= 500
    return False


def fetch_file(url: str, part: Path, remote: RemoteFile, *, headers: dict, meter: ProgressMeter,
               control: DownloadControl, stall_timeout: float = 30.0, max_retries: int = 5,
               retry_delay: float = 1.0, max_restarts: int = MAX_RESTARTS) -> str:
    """Bring `part` to the full content of `remote`; return its hex digest (not yet checked).

    An attempt counts as progress only if it got past the furthest byte reached before (a
    server that ignores Range sends the same first bytes again and again), and a server that
    ignores Range restarts the file from zero at most `max_restarts` times."""
    import httpx2
    from huggingface_hub.utils import get_session, hf_raise_for_status

    kind, _ = remote.expected_hash
    part.parent.mkdir(parents=True, exist_ok=True)
    part.touch(exist_ok=True)  # an empty file has no bytes to write but must still appear
    pos = part.stat().st_size
    if pos > remote.size:  # longer than the file: cannot be a prefix of it
        part.unlink()
        pos = 0
    hasher = hash_file(part, kind, remote.size) if pos else Hasher(kind, remote.size)
    meter.start_file(remote.name, remote.size, pos)
    session = get_session()
    timeout = httpx2.Timeout(stall_timeout, connect=stall_timeout)
    failures = 0
    restarts = 0
    furthest = pos  # the furthest byte this run has reached

    def on_pause():
        meter.flush()
        meter.emit("paused", remote.name, file_done=pos, file_total=remote.size)

    def on_resume():
        meter.reset_speed()
        meter.emit("resumed", remote.name, file_done=pos, file_total=remote.size)

    while pos < remote.size:
        control.checkpoint(on_pause, on_resume)
        request_headers = dict(headers)
        if pos:
            request_headers["Range"] = f"bytes={pos}-"
        progressed = False
        try:
            with session.stream("GET", url, headers=request_headers, timeout=timeout,
                                follow_redirects=True) as response:
                if response.status_code >= 400:
                    response.read()
                    hf_raise_for_status(response)
                if pos and response.status_code == 200:
                    # The server ignored Range: what it sends starts at byte 0.
                    restarts += 1
                    if restarts > max_restarts:
                        raise RangeIgnoredError(
                            f"the server ignores resume requests (Range) for {remote.name} and its transfers "
                            f"keep breaking off: restarted from zero {max_restarts} times; giving up. The partial "
                            "file is kept; try again later or from another mirror (HF_ENDPOINT)")
                    meter.discard(pos)
                    pos, hasher = 0, Hasher(kind, remote.size)
                    part.write_bytes(b"")
                    meter.emit("retry", remote.name, message="server ignored the range request; restarting this file")
                with open(part, "ab") as out:
                    for chunk in response.iter_bytes():  # as received: a cut loses nothing
                        if not chunk:
                            continue
                        if pos + len(chunk) > remote.size:
                            chunk = chunk[: remote.size - pos]  # extra bytes: a wrong file, caught by the hash
                        out.write(chunk)
                        hasher.update(chunk)
                        pos += len(chunk)
                        meter.add(len(chunk))
                        progressed = True
                        if pos >= remote.size or control.should_stop_stream():
                            break
            if pos < remote.size and not control.should_stop_stream():
                if pos <= furthest:  # ended cleanly but short, without getting any further
                    raise TransferError(f"the server sent no new data for {remote.name}")
                furthest, failures = pos, 0
        except Exception as exc:
            if isinstance(exc, RangeIgnoredError) or not (_retryable(exc) or isinstance(exc, TransferError)):
                raise
            progressed = pos > furthest  # net progress, not bytes received again
            furthest = max(furthest, pos)
            failures = 0 if progressed else failures + 1
            if failures > max_retries:
                raise TransferError(
                    f"downloading {remote.name} failed {failures} times in a row ({exc.__class__.__name__}); "
                    "the partial file is kept: download again to resume"
                ) from exc
            meter.flush()
            meter.emit("retry", remote.name, file_done=pos, file_total=remote.size,
                       message=f"{exc.__class__.__name__}: resuming at byte {pos}")
            control.sleep(retry_delay * max(failures, 1) if not progressed else 0, on_pause, on_resume)
    return hasher.hexdigest()
