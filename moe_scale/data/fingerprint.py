"""What text a run was trained on: each data file's size and the CRC-32 of its whole content, kept in the run
directory, so a resume on text that changed under it (an edit anywhere in a file, a replaced or regrown file,
another shard set) is caught before the saved vocabulary or the data position is applied to it.

    data_files.json   {"format": 2, "splits": {split: [{"path", "bytes", "crc32"}, ...]}, "accepted": [...]}

Cost: a file is read whole once; its CRC is then cached ($MOE_SCALE_CACHE/fingerprints) under what the file system
changes with any write to it (device, inode, size, mtime and ctime in ns; ctime cannot be set back by a user), so a
resume or a second run on the same files costs one stat per file. The files are split over the ranks (each hashes
every world-th file, one all-gather). docs/data.md has the measured rates. Format 1 (CRC-32 of the first and last
64 KiB only) is still read from older runs and compared in its own terms.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path

import torch.distributed as dist

from moe_scale.config import DataConfig
from moe_scale.data.embedded import cache_root
from moe_scale.data.text import resolve_text_files, split_files
from moe_scale.errors import UserError
from moe_scale.files import write_json_atomic
from moe_scale.run_files import RunFiles

DATA_FILES = RunFiles.DATA_FILES
FORMAT = 2
_EDGE = 1 << 16      # format 1's ends
_CHUNK = 1 << 22


def data_files(config: DataConfig) -> dict[str, list[Path]]:
    """Every file the data settings name, by split (--valid-data / --test-data replace the split's files)."""
    files = split_files(config.data)
    for split, spec in (("valid", config.valid_data), ("test", config.test_data)):
        if spec:
            files[split] = resolve_text_files(spec, f"--{split}-data")
    return files


def _unreadable(path: Path, e: OSError) -> UserError:
    return UserError(f"{path}: cannot be read ({e.strerror or e}); check its permissions and the disk")


def whole_crc32(path: Path) -> int:
    """CRC-32 of every byte of the file."""
    crc, buffer = 0, bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc


def edges_crc32(path: Path, size: int) -> int:
    """Format 1's fingerprint: CRC-32 of the first and last 64 KiB."""
    with open(path, "rb") as f:
        crc = zlib.crc32(f.read(_EDGE))
        if size > _EDGE:
            f.seek(max(_EDGE, size - _EDGE))
            crc = zlib.crc32(f.read(_EDGE), crc)
    return crc


def _cache_entry(path: Path) -> Path:
    return cache_root() / "fingerprints" / hashlib.sha1(str(path.resolve()).encode()).hexdigest()


def _file_print(path: Path) -> dict:
    """{"path", "bytes", "crc32"}: from the cache when the file's stat is the one cached, else read whole."""
    try:
        st = os.stat(path)
        key = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        entry = _cache_entry(path)
        try:
            cached = json.loads(entry.read_text())
            if cached.get("stat") == key:
                return {"path": str(path), "bytes": st.st_size, "crc32": cached["crc32"]}
        except (OSError, ValueError, AttributeError):
            pass
        crc = whole_crc32(path)
    except OSError as e:
        raise _unreadable(path, e) from None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(entry, {"path": str(path.resolve()), "stat": key, "crc32": crc})
    except OSError:
        pass   # a cache that cannot be written: the next start reads the file again
    return {"path": str(path), "bytes": st.st_size, "crc32": crc}


def fingerprint(config: DataConfig) -> dict:
    """The record of the files `config` names; every rank of a started world takes part (each hashes its share)."""
    by_split = data_files(config)
    files = [(split, Path(p)) for split, paths in by_split.items() for p in paths]
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = {i: _file_print(path) for i, (_, path) in enumerate(files) if i % world == rank}
    if world > 1:
        shares = [None] * world
        dist.all_gather_object(shares, mine)
        mine = {i: record for share in shares for i, record in share.items()}
    splits = {split: [] for split in by_split}
    for i, (split, _) in enumerate(files):
        splits[split].append(mine[i])
    return {"format": FORMAT, "splits": splits}


def changes(saved: dict, now: dict) -> list[str]:
    """How the data now differs from what the run recorded, a phrase per difference (empty: the same). Files
    compare by name, size and fingerprint, so a corpus moved to another directory is the same corpus."""
    out = []
    for split in sorted(set(saved["splits"]) | set(now["splits"])):
        before = {Path(f["path"]).name: f for f in saved["splits"].get(split, [])}
        after = {Path(f["path"]).name: f for f in now["splits"].get(split, [])}
        for name in sorted(before.keys() - after.keys()):
            out.append(f"{split} file {before[name]['path']} is gone")
        for name in sorted(after.keys() - before.keys()):
            out.append(f"{split} file {after[name]['path']} is new")
        for name in sorted(before.keys() & after.keys()):
            was, is_ = before[name], after[name]
            if was["bytes"] != is_["bytes"]:
                out.append(f"{split} file {is_['path']} had {was['bytes']} bytes and has {is_['bytes']}")
            elif was["crc32"] != is_["crc32"]:
                out.append(f"{split} file {is_['path']} has other content ({was['bytes']} bytes, as before)")
    return out


def read_record(run: Path) -> dict | None:
    """The run's record (None: a run from before records were kept, or no run)."""
    try:
        record = json.loads((run / DATA_FILES).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        raise UserError(f"{run / DATA_FILES} is unreadable; restore it from a copy of the run, or delete it to "
                        f"resume without checking the data") from None
    if not isinstance(record, dict) or not isinstance(record.get("splits"), dict):
        raise UserError(f"{run / DATA_FILES} is not the JSON moe_scale writes; restore it, or delete it to resume "
                        f"without checking the data")
    return record


def _edges_now(record: dict) -> int:
    path = Path(record["path"])
    try:
        return edges_crc32(path, record["bytes"])
    except OSError as e:
        raise _unreadable(path, e) from None


def check_resumed_data(saved: dict | None, now: dict, accept: bool) -> list[str]:
    """On --resume: the data's changes since the run recorded it (`saved`: read_record's; None, nothing to
    compare); refused in one line unless `accept`."""
    if saved is not None and saved.get("format", 1) == 1:   # recorded by an older version: its ends only
        now = {**now, "splits": {split: [{**f, "crc32": _edges_now(f)} for f in files]
                                 for split, files in now["splits"].items()}}
    found = changes(saved, now) if saved is not None else []
    if found and not accept:
        shown = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
        raise UserError(f"--resume: the training data changed since this run started ({shown}), and the run's "
                        f"vocabulary and data position belong to the old text; put the old data back, start a new "
                        f"run, or pass --accept-changed-data to resume on the new text on purpose")
    return found
