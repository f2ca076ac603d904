"""Pictures of a run: plots/ after training (curves, one expert-load heatmap per MoE layer, from
expert_load.jsonl, which a resume keeps step-unique), TensorBoard's load histograms, the heatmap's grouping at
thousands of experts, and eval --expert-stats' chart."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_scale.metrics.plots import MAX_ROWS, heatmap_rows, perplexity_lines, write_expert_stats_plot, write_run_plots
from tests.cli_runs import TINY, run_eval, run_train

PNG = b"\x89PNG"


def _is_png(path) -> bool:
    return path.exists() and path.read_bytes()[:4] == PNG and path.stat().st_size > 10_000


@pytest.mark.slow   # over 5 s on 2 cores (tests/README.md)
def test_a_run_writes_its_plots_and_per_interval_loads(tmp_path, embedded_cache):
    run = tmp_path / "run"
    common = [*TINY, "--model", "transformer", "--num-heads", "2", "--num-layers", "2", "--ffn", "moe",
              "--log-interval", "2", "--eval-interval", "4", "--checkpoint-interval", "4"]
    run_train([*common, "--max-steps", "6", "--out", str(run)], cwd=tmp_path, cache=embedded_cache)
    records = [json.loads(line) for line in (run / "expert_load.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6]
    for record in records:   # two MoE FFN layers of 8 experts, tokens routed / mean
        assert len(record["layers"]) == 2 and all(len(load) == 8 for load in record["layers"])
        assert all(abs(np.mean(load) - 1) < 1e-3 for load in record["layers"])
    for name in ("curves.png", "expert_load_layer0.png", "expert_load_layer1.png"):
        assert _is_png(run / "plots" / name), name
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run / "tb"), size_guidance={"histograms": 0})
    events.Reload()
    assert [e.step for e in events.Histograms("moe/load_over_mean/layer1")] == [2, 4, 6]

    (run / "checkpoints" / "complete").write_text(json.dumps({"tag": "step00000004", "step": 4}))
    run_train(["--resume", "--max-steps", "8", "--out", str(run)], cwd=tmp_path, cache=embedded_cache)
    steps = [json.loads(line)["step"] for line in (run / "expert_load.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6, 8]

    result = run_eval(["--run", str(run), "--expert-stats"], cwd=tmp_path, cache=embedded_cache)
    assert result["expert_stats_plot"] == str(run / "plots" / "eval_valid_step00000008_experts.png")
    assert _is_png(run / "plots" / "eval_valid_step00000008_experts.png")


def test_a_subword_run_draws_training_and_validation_perplexity_both_per_word(tmp_path, monkeypatch):
    """A BPE run's loss is per token and its validation perplexity per word: the curves turn the training loss
    into exp(loss x tokens per word) (what the log line prints), and the axis names the unit. Read back from
    the figure drawn for a run directory (train_log.jsonl, TensorBoard's valid/ppl)."""
    from moe_scale.metrics import plots
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "run"
    run.mkdir()
    (run / "train_log.jsonl").write_text("".join(json.dumps({"step": s, "loss": 2.0 + 0.01 * s}) + "\n"
                                                 for s in range(1, 101)))
    with SummaryWriter(str(run / "tb")) as writer:
        for step, ppl in ((50, 40.0), (100, 30.0)):
            writer.add_scalar("valid/ppl", ppl, step)
    figures = {}
    monkeypatch.setattr(plots, "save_figure_atomic", lambda fig, path, **kw: figures.__setitem__(path.name, fig))
    write_run_plots(run, tokens_per_word=1.5)
    right = figures["curves.png"].axes[1]
    assert right.get_ylabel() == "perplexity per word (1.500 tokens per word)"
    training, validation = right.get_lines()
    window = 2   # 100 steps / 50
    losses = np.array([2.0 + 0.01 * s for s in range(1, 101)])
    per_step_mean = (losses[1:] + losses[:-1]) / 2
    np.testing.assert_allclose(training.get_ydata(), np.exp(per_step_mean * 1.5))     # not exp(loss per token)
    np.testing.assert_allclose(training.get_xdata(), np.arange(window, 101))
    assert list(validation.get_xdata()) == [50, 100] and list(validation.get_ydata()) == [40.0, 30.0]
    (words_training,) = perplexity_lines([{"step": 1, "loss": 2.0}], [], 1.0)
    np.testing.assert_allclose(words_training[1], [np.exp(2.0)])                   # a word vocabulary: as it was


def test_the_heatmap_groups_thousands_of_experts_sorted_by_load():
    rng = np.random.default_rng(0)
    load = rng.gamma(2.0, size=(4096, 5))
    rows, label = heatmap_rows(load)
    assert rows.shape == (MAX_ROWS, 5) and "32 per row" in label
    order = np.argsort(-load.mean(axis=1), kind="stable")
    np.testing.assert_allclose(rows[0], load[order[:32]].mean(axis=0))
    assert np.all(np.diff(rows.mean(axis=1)) <= 1e-12)            # most loaded first
    small = load[:8]
    assert heatmap_rows(small)[0] is small


@pytest.mark.parametrize("experts", [8, 4096])
def test_expert_stats_chart(tmp_path, experts):
    rng = np.random.default_rng(1)
    report = {f"layer{i}": {"cv_load": 0.5, "cv_importance": 0.4, "tokens": 1000,
                            "experts": [{"expert": e, "load": int(rng.integers(0, 50)),
                                         "importance": float(rng.random())}
                                        for e in range(experts)]} for i in range(2)}
    assert _is_png(write_expert_stats_plot(report, tmp_path / "sub" / "chart.png"))
