"""tools/plan_paper.py: every Table 7 and 8 model on its paper cluster, its FLOPs the paper's rule's (as `moe-scale
flops` counts them), the prediction beside the paper's TFLOPS/GPU."""

from __future__ import annotations

import json

import pytest

from moe_scale.accounting.presets import PRESETS
from moe_scale.commands.flops import flops_report


def test_every_paper_row_beside_its_prediction(tmp_path, load_tool, capsys):
    tool = load_tool("plan_paper")
    assert tool.main(["--out", str(tmp_path / "paper.json")]) == 0
    rows = json.loads((tmp_path / "paper.json").read_text())
    paper = {p.name: p for p in PRESETS.values() if p.kind == "lstm" and p.paper is not None}
    assert [r["preset"] for r in rows] == list(paper)
    for r in rows:
        preset = paper[r["preset"]]
        assert (r["gpus"], r["paper_tflops_per_gpu"]) == (preset.cluster_gpus, preset.paper.tflops_per_gpu)
        assert r["predicted_over_paper"] == pytest.approx(r["predicted_tflops_per_gpu"] / r["paper_tflops_per_gpu"])
        flops = flops_report(preset.name)["training_flops_per_token"]
        assert r["predicted_tflops_per_gpu"] == pytest.approx(flops * r["batch_tokens"] / r["gpus"] / r["step_s"]
                                                              / 1e12)
        assert abs(r["batch_tokens"] - preset.batch_words) <= 32 * r["gpus"] * r["grad_accum"]   # whole sequences
        # the paper's batch per step fits a K40, in as few micro-batches as it can
        assert r["fits_k40"] and r["gib_per_gpu"] <= 11.17 * 0.95
        if r["grad_accum"] > 1:
            assert not tool._planned_row(preset, 4, None, r["grad_accum"] // 2)["fits_k40"]
    assert {r["preset"]: r["grad_accum"] for r in rows if r["grad_accum"] > 1}.keys() >= {"lm1b-moe-34m",
                                                                                      "lm1b-moe-143m"}
    assert "| news100b-moe-131072-h | 128 |" in capsys.readouterr().out


def test_bad_flags(load_tool, tmp_path):
    tool = load_tool("plan_paper")
    with pytest.raises(SystemExit) as stop:
        tool.main(["--gpus-per-node", "0"])
    assert stop.value.code == 2
    with pytest.raises(SystemExit):
        tool.main(["--out", str(tmp_path / "no" / "x.json")])
