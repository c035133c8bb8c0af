"""Build the demo model's training corpus from Debian's `r-cran-janeaustenr` package.

The package (MIT-licensed packaging by Julia Silge; the novels themselves are in the public
domain) holds the full text of Jane Austen's six novels as R character vectors, one printed
line per element, in R's lazy-load database `data/Rdata.rdb`. We read that file directly (no R
needed): it is a sequence of records, each a 4-byte big-endian length followed by a zlib
stream holding one object in R's XDR serialisation format. Each novel is a STRSXP.

Output: `train.txt` and `heldout.txt` (the last `--heldout-fraction` of every novel's
paragraphs), one paragraph per line, wrapped lines joined with spaces.

Usage:
    apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb pkg
    python tools/demo_model/prepare_corpus.py \
        --rdb pkg/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb --out /tmp/austen
"""

from __future__ import annotations

import argparse
import struct
import zlib
from pathlib import Path

_STRSXP = 16
_CHARSXP = 9
_NA_LENGTH = -1


def read_rdb_records(data: bytes) -> list[bytes]:
    """Split a lazy-load database into its decompressed records."""
    records, offset = [], 0
    while offset < len(data):
        (expected,) = struct.unpack(">I", data[offset : offset + 4])
        stream = zlib.decompressobj()
        payload = stream.decompress(data[offset + 4 :])
        if len(payload) != expected:
            raise ValueError(f"record at {offset}: {len(payload)} bytes, header says {expected}")
        offset = len(data) - len(stream.unused_data)
        records.append(payload)
    return records


def parse_character_vector(payload: bytes) -> list[str]:
    """Decode an XDR-serialised R character vector (format version 3)."""
    if payload[:2] != b"X\n":
        raise ValueError("not an XDR serialisation")
    pos = 2
    version, _writer, _min_reader = struct.unpack(">iii", payload[pos : pos + 12])
    pos += 12
    if version == 3:  # native encoding name follows
        (n,) = struct.unpack(">i", payload[pos : pos + 4])
        pos += 4 + n
    (flags,) = struct.unpack(">i", payload[pos : pos + 4])
    pos += 4
    if flags & 0xFF != _STRSXP:
        raise ValueError(f"object type {flags & 0xFF} is not a character vector")
    (length,) = struct.unpack(">i", payload[pos : pos + 4])
    pos += 4
    lines = []
    for _ in range(length):
        flags, n = struct.unpack(">ii", payload[pos : pos + 8])
        pos += 8
        if flags & 0xFF != _CHARSXP:
            raise ValueError("malformed character vector element")
        if n == _NA_LENGTH:
            lines.append("")
            continue
        lines.append(payload[pos : pos + n].decode("utf-8"))
        pos += n
    return lines


def paragraphs(lines: list[str]) -> list[str]:
    """Join printed lines into paragraphs; blank lines separate them."""
    out, current = [], []
    for line in lines:
        line = line.strip()
        if line:
            current.append(line)
        elif current:
            out.append(" ".join(current))
            current = []
    if current:
        out.append(" ".join(current))
    # Underscores mark italics in the Gutenberg transcription; they are noise to a small model.
    return [p.replace("_", "") for p in out]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rdb", required=True, type=Path, help="janeaustenr data/Rdata.rdb")
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--heldout-fraction", type=float, default=0.02)
    args = parser.parse_args(argv)

    train, heldout = [], []
    for record in read_rdb_records(args.rdb.read_bytes()):
        paras = paragraphs(parse_character_vector(record))
        cut = int(len(paras) * (1 - args.heldout_fraction))
        train.extend(paras[:cut])
        heldout.extend(paras[cut:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train.txt").write_text("\n".join(train) + "\n", encoding="utf-8")
    (args.out / "heldout.txt").write_text("\n".join(heldout) + "\n", encoding="utf-8")
    print(f"train: {len(train)} paragraphs, {sum(map(len, train))} chars; "
          f"heldout: {len(heldout)} paragraphs, {sum(map(len, heldout))} chars")


if __name__ == "__main__":
    main()
