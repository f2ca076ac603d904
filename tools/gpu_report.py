"""One JSON report (and a Markdown table) from what tools/gpu_check.sh wrote into its output directory.

    python tools/gpu_report.py OUT_DIR        # reads OUT_DIR/{tests.xml,layer.jsonl,lstm/,transformer/}

Checks each number against the GPU targets and says which hold:
    layer      >= 3x DeepSpeed's layer at E >= 256, never slower at E = 8, within 2x of the roofline at every E
    training   MFU >= 35% for the transformer MoE LM (the LSTM-MoE's is reported beside it)
Writes OUT_DIR/report.json and OUT_DIR/report.md, prints the Markdown.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SPEEDUP_AT_SCALE, SCALE_EXPERTS, ROOFLINE_WITHIN, MFU_TARGET = 3.0, 256, 2.0, 0.35


def tests_summary(path: Path) -> dict | None:
    if not path.is_file():
        return None
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def layer_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    table = []
    for row in rows:
        if row.get("impl") != "dropless":
            continue
        e = row["experts"]
        entry = {"experts": e, "k": row["k"]}
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
                          and r["k"] == row["k"]), None)
        if deepspeed and "time_s" in deepspeed:
            entry["deepspeed_ms"] = round(1000 * deepspeed["time_s"], 3)
        table.append(entry)
    return table


def training_summary(run: Path) -> dict | None:
    path = run / "summary.json"
    if not path.is_file():
        return None
    s = json.loads(path.read_text())
    return {key: s.get(key) for key in ("steps", "tokens_per_s", "tflops_per_device", "mfu", "peak_tflops_per_device",
                                        "peak_source", "train_ppl", "valid_ppl", "all_to_all_share")}


def build_report(out: Path) -> dict:
    report = {"tests": tests_summary(out / "tests.xml"), "layer": layer_rows(out / "layer.jsonl"),
              "lstm_moe": training_summary(out / "lstm"), "transformer_moe": training_summary(out / "transformer")}
    device = out / "device.txt"
    report["device"] = device.read_text().strip() if device.is_file() else None
    transformer = report["transformer_moe"]
    report["targets"] = {
        "speedup": all(r.get("meets_speedup") for r in report["layer"] if "skipped" not in r) if report["layer"]
        else None,
        "roofline": all(r.get("meets_roofline") for r in report["layer"] if "skipped" not in r) if report["layer"]
        else None,
        "transformer_mfu": None if not transformer or transformer["mfu"] is None else transformer["mfu"] >= MFU_TARGET,
    }
    return report


def markdown(report: dict) -> str:
    lines = [f"GPU check on {report['device'] or 'an unnamed device'}", ""]
    tests = report["tests"]
    if tests:
        lines += [f"CUDA tests: {tests['passed']} passed, {tests['failures']} failed, {tests['errors']} errors, "
                  f"{tests['skipped']} skipped", ""]
    if report["layer"]:
        lines += ["| E | k | ours ms | DeepSpeed ms | speed-up | roofline fraction | bound |", "|---|---|---|---|---|---|---|"]
        for r in report["layer"]:
            if "skipped" in r:
                lines.append(f"| {r['experts']} | {r['k']} | skipped: {r['skipped']} | | | | |")
            else:
                lines.append(f"| {r['experts']} | {r['k']} | {r['ms']} | {r.get('deepspeed_ms', '')} | "
                             f"{r['speedup_vs_deepspeed']} | {r['roofline_fraction']:.2f} | {r['bound']} |")
        lines.append("")
    for name in ("lstm_moe", "transformer_moe"):
        s = report[name]
        if s:
            lines.append(f"{name}: {s['tokens_per_s']:.0f} tokens/s, {s['tflops_per_device']:.1f} TFLOPS/device, "
                         f"MFU {s['mfu']:.1%} (peak {s['peak_tflops_per_device']} TFLOPS, {s['peak_source']})")
    lines += ["", "targets: " + ", ".join(f"{k} {'met' if v else 'missed' if v is not None else 'not measured'}"
                                          for k, v in report["targets"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("gpu_report.py: error: give the output directory of tools/gpu_check.sh", file=sys.stderr)
        return 2
    out = Path(argv[0])
    report = build_report(out)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (out / "report.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
