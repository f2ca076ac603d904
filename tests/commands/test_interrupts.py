"""Ctrl-C anywhere (issue 56, class 3): SIGINT and SIGTERM at a random moment of each command's work end it with one
line and the conventional exit status (130, 143), leaving nothing half-written; training's first signal instead
finishes the step, writes a checkpoint and exits 0 (tests/train/test_preemption.py), and a second Ctrl-C ends it
at once, as cleanly.

"A random moment of its work": each command first runs once whole under a counter of the calls into moe_scale's
code; then, once per signal, it runs again and the signal is sent to the process as the N-th of those calls
begins, N drawn uniformly from 2 to that count (seeded; the draw is in the assertion message). Call 1 is
`cli.main`'s own entry, before any handler can be in place; a user's window there is the import of moe_scale.cli,
which imports nothing heavy (the subcommands, torch among them, are imported inside it).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from pathlib import Path

import pytest

from moe_scale.cli import main as cli_main
from moe_scale.files import is_partial_write
from moe_scale.run_files import RunFiles
from moe_scale.train.checkpoint import latest_complete_tag, problem_with
from tests.cli_runs import TINY, cli_env, run_cli
from tests.wikitext import wikitext_sentences

MOE_SCALE = os.sep + "moe_scale" + os.sep
PLAN = "MOE_SCALE_TEST_INTERRUPT"   # "FILE" or "FILE:SIGINT@120,SIGINT@180" (FILE: the count of calls made)
STATUS = {"SIGINT": 130, "SIGTERM": 143}


def interrupted_main(argv: list[str]) -> int:
    """cli.main(argv), counting the calls into moe_scale (written to FILE at the end) and sending the planned
    signals to this process as the planned calls begin."""
    count_file, _, plan = os.environ[PLAN].partition(":")
    sends = [(int(at), getattr(signal, name)) for name, at in (item.split("@") for item in plan.split(",") if item)]
    calls = 0

    def hook(frame, event, arg):
        nonlocal calls
        if event == "call" and MOE_SCALE in frame.f_code.co_filename:
            calls += 1
            while sends and sends[0][0] == calls:
                os.kill(os.getpid(), sends.pop(0)[1])

    sys.settrace(hook)   # called as each frame begins (not for C calls); returns None: no line events
    try:
        return cli_main(argv)
    finally:
        sys.settrace(None)
        Path(count_file).write_text(str(calls))


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _left_partial(root: Path) -> list[str]:
    """What a write cut short would leave: temporary files, partial directories."""
    return [str(p.relative_to(root)) for p in root.rglob("*")
            if is_partial_write(p.name) or ".partial" in p.name or p.name.endswith(".tmp")]


def _run(args: list[str], cwd: Path, cache: Path, plan: str):
    return run_cli(*args, cwd=cwd, cache=cache, entry=interrupted_main, env=_env(cache, f"{cwd / 'calls'}:{plan}"))


def _run_until_sent(args: list[str], cwd: Path, cache: Path, names: list[str], calls: int, draw):
    """Runs with `names` sent at drawn calls; a run that made fewer calls than drawn (a cache the counted run
    filled) before the first is run again with the draw taken from its own count. Returns (the process, the plan)."""
    for _ in range(3):
        plan = ",".join(f"{name}@{at}" for name, at in zip(names, sorted(draw(calls) for _ in names)))
        proc = _run(args, cwd, cache, plan)
        made = int((cwd / "calls").read_text())
        if made >= int(plan.split(",")[0].split("@")[1]):   # the first was sent (it may end the command)
            return proc, plan
        calls = made
    raise AssertionError(f"{args[0]}: no run reached the drawn calls ({plan}, {made} made)")


def _env(cache: Path, plan: str) -> dict[str, str]:
    return {**cli_env(cache), PLAN: plan}


def _count(args: list[str], cwd: Path, cache: Path) -> int:
    proc = _run(args, cwd, cache, "")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int((cwd / "calls").read_text())


def _assert_ended_by(proc, name: str, why: str) -> None:
    assert proc.returncode == STATUS[name], f"{why}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr + proc.stdout, f"{why}:\n{proc.stderr[-3000:]}"
    assert proc.stderr.strip().splitlines() == [
        f"moe-scale: stopped by {name} before finishing; nothing half-written was left"], f"{why}:\n{proc.stderr}"


def _assert_train_ended_cleanly(proc, run: Path, plan: str) -> None:
    """Either the step loop caught the (first) signal: a checkpoint, exit 0; or the command ended at once: one
    line. Either way the lock is gone and the newest checkpoint is whole."""
    if proc.returncode == 0:
        first = plan.split(",")[0].split("@")[0]
        assert f"stopped by {first} after step" in proc.stdout, f"{plan}:\n{proc.stdout[-2000:]}"
        assert "Traceback" not in proc.stderr, f"{plan}:\n{proc.stderr[-3000:]}"
    else:
        _assert_ended_by(proc, plan.split(",")[-1].split("@")[0], plan)
    assert not (run / "lock").exists(), plan
    tag = latest_complete_tag(run) if run.exists() else None
    if tag is not None:
        assert problem_with(RunFiles(run).checkpoints / tag) is None, plan


@pytest.fixture(scope="module")
def draw():
    rng = random.Random(56)
    return lambda count: rng.randint(2, count)


TRAIN = ["train", *TINY, "--model", "transformer", "--attention", "mha", "--num-heads", "4", "--ffn", "moe",
         "--num-layers", "1", "--max-steps", "2", "--checkpoint-interval", "1", "--eval-interval", "2"]


@pytest.mark.slow   # 22 runs of the 7 commands
def test_ctrl_c_and_sigterm_anywhere_in_each_command(tmp_path, embedded_cache, draw):
    run = tmp_path / "run"
    calls = _count([*TRAIN, "--out", str(run)], tmp_path, embedded_cache)
    for names in (["SIGTERM"], ["SIGINT", "SIGINT"]):   # (a Ctrl-C the run survives: its first SIGINT)
        other = tmp_path / f"run-{'-'.join(names)}"
        proc, plan = _run_until_sent([*TRAIN, "--out", str(other)], tmp_path, embedded_cache, names, calls, draw)
        _assert_train_ended_cleanly(proc, other, plan)
        assert not other.exists() or not _left_partial(other), (plan, _left_partial(other))

    out, text = tmp_path / "out", tmp_path / "text.txt"
    out.mkdir()
    text.write_text("\n".join(wikitext_sentences("test")[:40]) + "\n", encoding="utf-8")
    commands = {
        "eval": ["eval", "--run", str(run), "--data", str(text), "--json"],
        "generate": ["generate", "--run", str(run), "--max-new-tokens", "4", "--greedy"],
        "flops": ["flops", "--preset", "lm1b-moe-4096-h", "--json"],
        "plan": ["plan", "--preset", "lm1b-moe-4096-h", "--nodes", "1,2", "--gpus-per-node", "8",
                 "--plot", str(out / "plan.png")],
        "export": ["export", "--run", str(run), "--out", str(out / "hf")],
        "prune-heads": ["prune-heads", "--run", str(run), "--steps", "1", "--fraction-per-step", "0.25",
                        "--max-batches", "1", "--data", str(text), "--out", str(out / "pruning")],
    }
    for command, args in commands.items():
        calls = _count(args, tmp_path, embedded_cache)
        whole = _tree(out)
        for path in out.iterdir():   # each interrupted run starts from what a user had before the command
            _remove(path)
        before = _tree(tmp_path)
        for name in ("SIGINT", "SIGTERM"):
            proc, plan = _run_until_sent(args, tmp_path, embedded_cache, [name], calls, draw)
            if proc.returncode == 0:   # the signal came as its last calls ended: the command's whole result
                assert _tree(out) == {k: v for k, v in whole.items() if k in _tree(out)}, (command, plan)
            else:
                _assert_ended_by(proc, name, f"{command} {plan}")
                after = _tree(tmp_path)
                changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
                assert changed <= {"calls"} | _whole_outputs(out, tmp_path, whole), (command, plan, changed)
            assert not _left_partial(tmp_path), (command, plan, _left_partial(tmp_path))
            for path in out.iterdir():
                _remove(path)


def _whole_outputs(out: Path, root: Path, whole: dict[str, bytes]) -> set[str]:
    """The outputs an interrupted command may have finished: each file exactly as the whole run wrote it (a
    report with timings: whole JSON)."""
    done = set()
    for relative, content in _tree(out).items():
        if relative.endswith(".json") and relative in whole:
            json.loads(content)
        elif whole.get(relative) != content:
            continue
        done.add(str((out / relative).relative_to(root)))
    return done


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path) if path.is_dir() else path.unlink()
