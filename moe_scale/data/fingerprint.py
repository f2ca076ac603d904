"""What text a run was trained on: each data file's size and a cheap fingerprint (CRC-32 of its first and last
64 KiB), kept in the run directory, so a resume on text that changed under it (a replaced or regrown file, another
shard set) is caught before the saved vocabulary or the data position is applied to it.

    data_files.json   {"format": 1, "splits": {split: [{"path", "bytes", "crc32"}, ...]}, "accepted": [...]}
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from moe_scale.config import DataConfig
from moe_scale.data.text import resolve_text_files, split_files
from moe_scale.errors import UserError
from moe_scale.run_files import RunFiles

DATA_FILES = RunFiles.DATA_FILES
_EDGE = 1 << 16


def data_files(config: DataConfig) -> dict[str, list[Path]]:
    """Every file the data settings name, by split (--valid-data / --test-data replace the split's files)."""
    files = split_files(config.data)
    for split, spec in (("valid", config.valid_data), ("test", config.test_data)):
        if spec:
            files[split] = resolve_text_files(spec, f"--{split}-data")
    return files


def _file_print(path: Path) -> dict:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            crc = zlib.crc32(f.read(_EDGE))
            if size > _EDGE:
                f.seek(max(_EDGE, size - _EDGE))
                crc = zlib.crc32(f.read(_EDGE), crc)
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror or e}); check its permissions and the disk") from None
    return {"path": str(path), "bytes": size, "crc32": crc}


def fingerprint(config: DataConfig) -> dict:
    return {"format": 1, "splits": {split: [_file_print(Path(p)) for p in paths]
                                    for split, paths in data_files(config).items()}}


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


def check_resumed_data(saved: dict | None, now: dict, accept: bool) -> list[str]:
    """On --resume: the data's changes since the run recorded it (`saved`: read_record's; None, nothing to
    compare); refused in one line unless `accept`."""
    found = changes(saved, now) if saved is not None else []
    if found and not accept:
        shown = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
        raise UserError(f"--resume: the training data changed since this run started ({shown}), and the run's "
                        f"vocabulary and data position belong to the old text; put the old data back, start a new "
                        f"run, or pass --accept-changed-data to resume on the new text on purpose")
    return found
