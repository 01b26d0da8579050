"""Manifest checksums (issue 13, item 1): CRC32C by default, xxh3_128 and sha256 by choice, the
algorithm recorded per file, version-1 (sha256) manifests still verifying, damage caught with each."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from cadence.checkpoint import CheckpointManager
from cadence.checkpoint import checksum as checksum_lib
from cadence.checkpoint import manifest as manifest_lib
from cadence.config import load_config
from cadence.errors import ConfigError, CorruptCheckpointError


class Blob:
    def __init__(self, files: dict[str, bytes] | None = None) -> None:
        self.files = dict(files or {})

    def save_checkpoint(self, writer):
        for name, data in self.files.items():
            writer.write(name, data)
        return None

    def load_checkpoint(self, reader, state):
        self.files = {n: reader.read(n) for n in reader.names() if n != "state.json"}


def test_known_vectors() -> None:
    # CRC32C check value (RFC 3720 / iSCSI): "123456789" -> e3069283, the value S3 reports (base64) for it
    assert checksum_lib.checksum_of("crc32c", b"123456789") == "e3069283"
    assert checksum_lib.checksum_of("sha256", b"") == hashlib.sha256(b"").hexdigest()
    assert checksum_lib.checksum_of("xxh3_128", b"") == "99aa06d3014798d86001c324468d497f"  # XXH3-128 of ""
    pieces = checksum_lib.new("crc32c")
    for part in (b"1234", bytearray(b"567"), memoryview(b"89")):
        pieces.update(part)
    assert pieces.hexdigest() == "e3069283"
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5': expected one of crc32c, xxh3_128, sha256"):
        checksum_lib.new("md5")


@pytest.mark.parametrize("algorithm", checksum_lib.ALGORITHMS)
def test_each_algorithm_is_recorded_per_file_and_catches_a_flipped_byte(tmp_path: Path, algorithm: str) -> None:
    payload = {"a.bin": os.urandom(100_000), "empty.bin": b""}
    manager = CheckpointManager(str(tmp_path), checksum=algorithm)
    manager.save(1, {"blob": Blob(payload)})
    entries = manager.manifest(1)["files"]
    for name, data in payload.items():
        assert entries[name] == {"size": len(data), algorithm: checksum_lib.checksum_of(algorithm, data)}
    assert set(entries["state.json"]) == {"size", algorithm}
    restored = Blob()
    CheckpointManager(str(tmp_path), writer=False).restore({"blob": restored})
    assert restored.files == payload
    target = tmp_path / "ckpt-1" / "a.bin"
    data = bytearray(target.read_bytes())
    data[54_321] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=f"a.bin does not match its {algorithm} in the manifest"):
        CheckpointManager(str(tmp_path), writer=False).restore({"blob": Blob()}, step=1)


def test_a_version_1_sha256_manifest_keeps_verifying(tmp_path: Path) -> None:
    """A checkpoint written before version 2: every entry is ``sha256``, ``version`` is 1."""
    manager = CheckpointManager(str(tmp_path))
    manager.save(4, {"blob": Blob({"w.bin": b"weights" * 1000})})
    ckpt = tmp_path / "ckpt-4"
    old = {"format": "cadence-checkpoint", "version": 1, "step": 4, "time": 1.0,
           "files": {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                     for p in ckpt.iterdir() if p.name != "MANIFEST.json"}}
    (ckpt / "MANIFEST.json").write_text(json.dumps(old))
    restored = Blob()
    assert CheckpointManager(str(tmp_path), writer=False).restore({"blob": restored}) == 4
    assert restored.files == {"w.bin": b"weights" * 1000}
    (ckpt / "w.bin").write_bytes(b"Weights" * 1000)
    with pytest.raises(CorruptCheckpointError, match="w.bin does not match its sha256"):
        CheckpointManager(str(tmp_path), writer=False).restore({"blob": Blob()}, step=4)


@pytest.mark.parametrize("entry, reason", [
    ({"size": 1, "crc32c": "0000000"}, "bad crc32c '0000000' (expected 8 lowercase hex digits)"),
    ({"size": 1, "crc32c": "00000000", "sha256": "0" * 64}, "must have 'size' and one checksum"),
    ({"size": 1}, "must have 'size' and one checksum"),
    ({"size": 1, "md5": "0" * 32}, "must have 'size' and one checksum of crc32c, xxh3_128, sha256"),
])
def test_malformed_entries_are_corrupt(entry: dict, reason: str) -> None:
    doc = manifest_lib.build(2, {"x.bin": (1, "00000000")})
    doc["files"]["x.bin"] = entry
    with pytest.raises(CorruptCheckpointError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        manifest_lib.parse(manifest_lib.encode(doc), path="ckpt-2", step=2)


def test_version_1_allows_only_sha256() -> None:
    doc = manifest_lib.build(2, {"x.bin": (1, "00000000")}, algorithm="crc32c")
    doc["version"] = 1
    with pytest.raises(CorruptCheckpointError, match="one checksum of sha256; it has"):
        manifest_lib.parse(manifest_lib.encode(doc), path="ckpt-2", step=2)
    doc["version"] = 4
    with pytest.raises(CorruptCheckpointError, match=r"unsupported version 4 \(this cadence reads 1, 2, 3\)"):
        manifest_lib.parse(manifest_lib.encode(doc), path="ckpt-2", step=2)


def test_config_selects_the_checksum(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("task: {class: tests.tasks:TinyTask}\n")
    assert load_config(str(path)).checkpoint.checksum == "crc32c"
    assert load_config(str(path), ["checkpoint.checksum=sha256"]).checkpoint.checksum == "sha256"
    with pytest.raises(ConfigError, match="checkpoint.checksum: expected one of 'crc32c', 'xxh3_128', 'sha256'"):
        load_config(str(path), ["checkpoint.checksum=md5"])
