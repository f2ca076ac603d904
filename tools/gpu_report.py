#!/usr/bin/env python
"""The record of tools/gpu_check.sh: OUT/summary.json, rewritten after every stage, and OUT/report.md from it.

    python tools/gpu_report.py OUT --record NAME STATUS SECONDS [--limit S] [--work DIR] [--note TEXT]
    python tools/gpu_report.py OUT --start KEY=VALUE...     # a new summary: what the check runs with
    python tools/gpu_report.py OUT --finish EXIT_STATUS
    python tools/gpu_report.py OUT                          # report.md again from summary.json (and printed)

--record adds (or replaces) one stage: its status (ok, failed, timeout, skipped), seconds, limit and key numbers,
read from what the stage left in WORK/stages/NAME: env.json (env), the pytest lines of its log (stages named
tests*), run/summary.json (training runs); and OUT/NAME.jsonl (the layer benchmarks, the whole-step probe). It then
checks the GPU targets against the numbers so far and rewrites OUT/report.md. summary.json is written to a new
file and renamed over the old, so a check cut at any moment leaves a whole one.

Targets: the layer (bfloat16, stage `layer`) >= 3x DeepSpeed's at E >= 256, never slower at E = 8, within 2x of
the roofline at every E; MFU >= 35% for the transformer MoE (stage `train`); at most 2 host reads per regular
training step (stage `step_syncs`, where its rows say `host_reads`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

SPEEDUP_AT_SCALE, SCALE_EXPERTS, ROOFLINE_WITHIN, MFU_TARGET, HOST_READS_TARGET = 3.0, 256, 2.0, 0.35, 2
STATUSES = ("ok", "failed", "timeout", "skipped")
_PYTEST_LINE = re.compile(r"^(\S+::\S+(?:\[[^\]]*\])?)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)
_TRAINING_KEYS = ("steps", "tokens_per_s", "tflops_per_device", "mfu", "peak_tflops_per_device", "peak_source",
                  "train_ppl", "valid_ppl", "all_to_all_share")


# ---------------------------------------------------------------- what each stage left


def env_numbers(path: Path) -> dict:
    if not path.is_file():
        return {}
    info = json.loads(path.read_text())
    numbers = {k: info.get(k) for k in ("python", "device", "capability", "memory_gib", "torch_cuda", "nccl",
                                        "grouped_mm", "cuda_available", "error") if k in info}
    numbers["versions"] = {n: v.get("version", "FAILED") for n, v in info.get("imports", {}).items()}
    numbers["import_seconds"] = round(sum(v.get("seconds", 0) for v in info.get("imports", {}).values()), 1)
    if "cpu_builds_seconds" in info:
        numbers["cpu_builds_seconds"] = info["cpu_builds_seconds"]
    return numbers


def pytest_numbers(log: Path) -> dict:
    """Counts of the verbose pytest lines (`path::test PASSED`): read as they were printed, so a stage stopped
    at its limit still counts what finished."""
    if not log.is_file():
        return {}
    results = dict(_PYTEST_LINE.findall(log.read_text(errors="replace")))
    counts = {key: sum(r == word for r in results.values()) for key, word in
              (("passed", "PASSED"), ("failed", "FAILED"), ("errors", "ERROR"), ("skipped", "SKIPPED"))}
    counts["not_passed"] = sorted(name.split("::", 1)[1] for name, r in results.items() if r in ("FAILED", "ERROR"))
    return counts


def jsonl_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:   # a line cut by the stage's limit
            pass
    return rows


def layer_rows(rows: list[dict]) -> list[dict]:
    """One entry per (dtype, E, k) of ours (`dropless`) with DeepSpeed's time beside it and the targets it meets."""
    table = []
    for row in rows:
        if row.get("impl") != "dropless":
            continue
        e = row["experts"]
        entry = {"dtype": row.get("dtype"), "experts": e, "k": row["k"]}
        if "skipped" in row:
            entry["skipped"] = row["skipped"]
        else:
            speedup = row.get("speedup_vs_deepspeed")
            entry.update(ms=round(1000 * row["time_s"], 3), speedup_vs_deepspeed=speedup,
                         roofline_fraction=row["roofline_fraction"], bound=row["bound"],
                         meets_speedup=None if speedup is None else
                         speedup >= (SPEEDUP_AT_SCALE if e >= SCALE_EXPERTS else 1.0 if e <= 8 else 0.0),
                         meets_roofline=row["roofline_fraction"] >= 1 / ROOFLINE_WITHIN)
        deepspeed = next((r for r in rows if r.get("impl") == "deepspeed_dropless" and r["experts"] == e
                          and r["k"] == row["k"] and r.get("dtype") == row.get("dtype")), None)
        if deepspeed and "time_s" in deepspeed:
            entry["deepspeed_ms"] = round(1000 * deepspeed["time_s"], 3)
        table.append(entry)
    return table


def training_numbers(run: Path) -> dict:
    path = run / "summary.json"
    if not path.is_file():
        return {}
    s = json.loads(path.read_text())
    return {key: s.get(key) for key in _TRAINING_KEYS}


def probe_rows(rows: list[dict]) -> list[dict]:
    """The whole-step probe's rows, their numbers and short strings only (file:line lists stay in its JSONL)."""
    return [{k: v for k, v in row.items() if isinstance(v, (int, float, bool)) or
             (isinstance(v, str) and len(v) <= 80)} for row in rows]


def stage_numbers(name: str, out: Path, work: Path | None) -> dict:
    left = work / "stages" / name if work else None
    if name == "env" and left:
        return env_numbers(left / "env.json")
    if name.startswith("tests") and left:
        return pytest_numbers(left / "log")
    if name.startswith("layer"):
        return {"rows": layer_rows(jsonl_rows(out / f"{name}.jsonl"))}
    if name == "step_syncs":
        return {"rows": probe_rows(jsonl_rows(out / f"{name}.jsonl"))}
    if left and (left / "run" / "summary.json").is_file():
        return training_numbers(left / "run")
    return {}


# ---------------------------------------------------------------- summary.json


def load(out: Path) -> dict:
    path = out / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {"check": {}, "stages": []}


def save(out: Path, summary: dict) -> None:
    summary["targets"] = targets(summary)
    path = out / "summary.json"
    partial = out / ".summary.json.partial"
    partial.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(partial, path)
    (out / "report.md").write_text(markdown(summary))


def stage(summary: dict, name: str) -> dict | None:
    return next((s for s in summary["stages"] if s["name"] == name), None)


def record(summary: dict, name: str, status: str, seconds: float, limit: float | None, note: str | None,
           numbers: dict) -> None:
    entry = {"name": name, "status": status, "seconds": round(seconds, 1)}
    if limit is not None:
        entry["limit_s"] = limit
    if note:
        entry["note"] = note
    entry.update(numbers)
    stages = [s for s in summary["stages"] if s["name"] != name]
    summary["stages"] = stages + [entry]
    summary["check"]["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if name == "env" and numbers.get("device"):
        summary["device"] = f"{numbers['device']}, compute capability {numbers.get('capability')}, " \
                            f"{numbers.get('memory_gib')} GiB"


def targets(summary: dict) -> dict:
    layer = [r for r in (stage(summary, "layer") or {}).get("rows", []) if "skipped" not in r]
    train = stage(summary, "train") or {}
    probe = [r for r in (stage(summary, "step_syncs") or {}).get("rows", []) if "host_reads" in r]
    return {
        "speedup": all(r.get("meets_speedup") for r in layer) if layer else None,
        "roofline": all(r.get("meets_roofline") for r in layer) if layer else None,
        "transformer_mfu": None if train.get("mfu") is None else train["mfu"] >= MFU_TARGET,
        "host_reads": all(r["host_reads"] <= HOST_READS_TARGET for r in probe) if probe else None,
    }


# ---------------------------------------------------------------- report.md


def markdown(summary: dict) -> str:
    check = summary.get("check", {})
    lines = [f"GPU check on {summary.get('device') or 'an unnamed device'}"
             + (" (REHEARSE: on the CPU, CPU sizes)" if check.get("rehearse") == "1" else ""), ""]
    lines += ["| stage | status | seconds | limit | numbers |", "|---|---|---|---|---|"]
    for s in summary["stages"]:
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']} | {s.get('limit_s', '')} | {_brief(s)} |")
    for s in summary["stages"]:
        if s["name"].startswith("layer") and s.get("rows"):
            lines += ["", f"{s['name']}:", "",
                      "| dtype | E | k | ours ms | DeepSpeed ms | speed-up | roofline fraction | bound |",
                      "|---|---|---|---|---|---|---|---|"]
            for r in s["rows"]:
                if "skipped" in r:
                    lines.append(f"| {r['dtype']} | {r['experts']} | {r['k']} | skipped: {r['skipped']} | | | | |")
                else:
                    lines.append(f"| {r['dtype']} | {r['experts']} | {r['k']} | {r['ms']} | "
                                 f"{r.get('deepspeed_ms', '')} | {r['speedup_vs_deepspeed']} | "
                                 f"{r['roofline_fraction']:.2f} | {r['bound']} |")
    lines += ["", "targets: " + ", ".join(f"{k} {'met' if v else 'missed' if v is not None else 'not measured'}"
                                          for k, v in summary.get("targets", targets(summary)).items())]
    if "exit_status" in check:
        lines.append(f"finished with exit status {check['exit_status']} after {check.get('elapsed_s')} s")
    return "\n".join(lines) + "\n"


def _brief(s: dict) -> str:
    if s.get("note"):
        return s["note"]
    if "passed" in s:
        text = f"{s['passed']} passed, {s['failed']} failed, {s['errors']} errors, {s['skipped']} skipped"
        return text + (f" ({', '.join(s['not_passed'])})" if s.get("not_passed") else "")
    if "tokens_per_s" in s and s["tokens_per_s"] is not None:
        return (f"{s['tokens_per_s']:.0f} tokens/s, {s['tflops_per_device']:.3g} TFLOPS/device, MFU {s['mfu']:.1%} "
                f"(peak {s['peak_tflops_per_device']:.4g} TFLOPS, {str(s['peak_source'])[:40]})")
    if "versions" in s:
        versions = ", ".join(f"{n} {v}" for n, v in s["versions"].items())
        return (f"{s['error']}: " if s.get("error") else "") + f"{versions}; imports {s['import_seconds']} s"
    if "rows" in s:
        return f"{len(s['rows'])} rows"
    return ""


# ---------------------------------------------------------------- command line


def _fail(message: str) -> int:
    print(f"gpu_report.py: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or not Path(argv[0]).is_dir():
        return _fail("give the output directory of tools/gpu_check.sh first")
    out, rest = Path(argv[0]), argv[1:]
    if not rest:
        if not (out / "summary.json").is_file():
            return _fail(f"{out} has no summary.json: not an output directory of tools/gpu_check.sh")
        summary = load(out)
        save(out, summary)
        print(markdown(summary), end="")
        return 0
    summary = load(out)
    if rest[0] == "--start":
        summary = {"check": dict(item.split("=", 1) for item in rest[1:]), "stages": []}
        summary["check"]["started"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    elif rest[0] == "--finish" and len(rest) == 3:
        summary["check"].update(exit_status=int(rest[1]), elapsed_s=float(rest[2]))
    elif rest[0] == "--record" and len(rest) >= 4:
        name, status, seconds = rest[1], rest[2], float(rest[3])
        if status not in STATUSES:
            return _fail(f"status {status!r}: one of {', '.join(STATUSES)}")
        options = dict(zip(rest[4::2], rest[5::2]))
        work = Path(options["--work"]) if "--work" in options else None
        limit = float(options["--limit"]) if "--limit" in options else None
        record(summary, name, status, seconds, limit, options.get("--note"), stage_numbers(name, out, work))
    else:
        return _fail("usage: gpu_report.py OUT [--start KEY=VALUE... | --record NAME STATUS SECONDS [--limit S] "
                     "[--work DIR] [--note TEXT] | --finish EXIT_STATUS ELAPSED_S]")
    save(out, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
