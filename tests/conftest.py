"""Shared fixtures: real-text corpora built from WikiText-2 (tests/wikitext.py), the tools' modules, and the
checks every test passes through (no command left running, no /dev/shm segment leaked, multiprocess marks)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from tests.paths import TOOLS
from tests.wikitext import wikitext_sentences, wikitext_text

if str(TOOLS) not in sys.path:   # the developer harnesses tests use (op_count, step_syncs) live with the tools
    sys.path.insert(0, str(TOOLS))

pytest_plugins = ["tests.parallel", "tests.timing_report"]


@pytest.fixture
def wikitext_dir(tmp_path) -> Path:
    """A directory holding WikiText-2's valid.txt and test.txt, as the tools' --wikitext takes."""
    directory = tmp_path / "wikitext-2"
    directory.mkdir()
    for split in ("valid", "test"):
        (directory / f"{split}.txt").write_text(wikitext_text(split), encoding="utf-8")
    return directory


def _tree_digest(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _shared_run(tmp_path_factory, cache: Path, name: str, flags: list[str]):
    """Train once for the session; after the session the run must be as trained (a test that changes a shared
    run must copy it first)."""
    from tests.cli_runs import TINY, run_train

    run = tmp_path_factory.mktemp(name) / "run"
    run_train([*TINY, *flags, "--out", str(run)], cwd=run.parent, cache=cache)
    trained = _tree_digest(run)
    yield run
    assert _tree_digest(run) == trained, f"a test changed the shared run {name}: copy it (shutil.copytree) first"


@pytest.fixture(scope="session")
def lstm_run(tmp_path_factory, embedded_cache) -> Path:
    """An LSTM-MoE run (tests/cli_runs.TINY, 4 steps) with complete checkpoints after steps 2 and 4, trained
    once per session for the tests that read a trained run (eval, generate, the bad-input table's copies)."""
    yield from _shared_run(tmp_path_factory, embedded_cache, "lstm_run",
                           ["--max-steps", "4", "--checkpoint-interval", "2"])


@pytest.fixture(scope="session")
def moa_moe_run(tmp_path_factory, embedded_cache) -> Path:
    """A transformer with MoA attention and an MoE FFN (TINY, 2 blocks, context 16, 2 steps), trained once per
    session for the tests that read a trained transformer run."""
    yield from _shared_run(tmp_path_factory, embedded_cache, "moa_moe_run",
                           ["--model", "transformer", "--attention", "moa", "--moa-num-experts", "4",
                            "--moa-top-k", "2", "--ffn", "moe", "--num-layers", "2", "--max-steps", "2"])


@pytest.fixture(scope="session")
def load_tool():
    """load_tool("count_ops") -> tools/count_ops.py as a module, imported once per session as
    `python tools/count_ops.py` sees it: tools/ on sys.path (for tool_args, json_lines) and the module in
    sys.modules under its own name (dataclasses look their module up there)."""
    loaded = {}

    def load(name: str):
        if name not in loaded:
            if str(TOOLS) not in sys.path:
                sys.path.insert(0, str(TOOLS))
            spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            loaded[name] = module
        return loaded[name]

    return load


@pytest.fixture
def lm1b_shards(tmp_path) -> Path:
    """An lm1b-style corpus under tmp_path/"lm1b", one sentence per line:
    training/news.en-0000{0..3}-of-00004 (WikiText-2 valid) and heldout/news.en.heldout-00000-of-00001
    (the first eighth of WikiText-2 test: what a test evaluates whole). Returns the root (so
    `split_files(str(root))` sees training/ and heldout/)."""
    root = tmp_path / "lm1b"
    (root / "training").mkdir(parents=True)
    (root / "heldout").mkdir()
    train = wikitext_sentences("valid")
    n = len(train)
    for k in range(4):
        chunk = train[k * n // 4: (k + 1) * n // 4]
        (root / "training" / f"news.en-{k:05d}-of-00004").write_text("\n".join(chunk) + "\n", encoding="utf-8")
    heldout = wikitext_sentences("test")
    heldout = heldout[:len(heldout) // 8]
    (root / "heldout" / "news.en.heldout-00000-of-00001").write_text("\n".join(heldout) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory) -> Path:
    """A session-wide MOE_SCALE_CACHE, so the embedded corpus is generated once per test session. Its kernels/
    links to this machine's own cache of moe_scale's CPU kernels: built once per machine, not once per session
    (they are keyed by source, flags and CPU model, so sharing them is safe)."""
    from moe_scale.data.embedded import cache_root

    cache = tmp_path_factory.mktemp("moe_scale_cache")
    machine_kernels = cache_root() / "kernels"
    try:
        machine_kernels.mkdir(parents=True, exist_ok=True)
        (cache / "kernels").symlink_to(machine_kernels, target_is_directory=True)
    except OSError:   # no writable home: the session builds its own
        pass
    return cache


@pytest.fixture
def lm1b_benchmark(tmp_path) -> Path:
    """The 1B-word benchmark's own layout under tmp_path/"1b" (WikiText-2 text, one sentence per line):
    training-monolingual.tokenized.shuffled/news.en-0000{1..5}-of-00100 (WikiText-2 valid; 5 shards, so
    they do not divide 2 x 2 or 3 x 1 readers) and heldout-monolingual.tokenized.shuffled/
    news.en.heldout-0000{0..2}-of-00050 (WikiText-2 test in 3 shards)."""
    root = tmp_path / "1b"
    train_dir = root / "training-monolingual.tokenized.shuffled"
    held_dir = root / "heldout-monolingual.tokenized.shuffled"
    train_dir.mkdir(parents=True)
    held_dir.mkdir()
    layout = ((train_dir, wikitext_sentences("valid"), "news.en-{:05d}-of-00100", 5),
              (held_dir, wikitext_sentences("test"), "news.en.heldout-{:05d}-of-00050", 3))
    for directory, sentences, name, shards in layout:
        n = len(sentences)
        first = 1 if directory is train_dir else 0   # lm1b's training shards start at 00001
        for k in range(shards):
            chunk = sentences[k * n // shards: (k + 1) * n // shards]
            (directory / name.format(first + k)).write_text("\n".join(chunk) + "\n", encoding="utf-8")
    return root


@pytest.fixture(autouse=True)
def processes_end_and_match_the_marker(request):
    """A test that fails half-way leaves no command running (tests/forked.py's children are killed), and a test
    that started several ranks (tests/cli_runs.py, tests/multiproc.py) is marked `multiprocess`, so that
    `-m "not multiprocess"` really runs one process at a time."""
    from tests import forked

    forked.most_ranks_since_asked()
    yield
    forked.kill_all()
    ranks = forked.most_ranks_since_asked()
    if ranks > 1 and request.node.get_closest_marker("multiprocess") is None:
        pytest.fail(f"{request.node.nodeid} started {ranks} ranks: mark it @pytest.mark.multiprocess")


def _deepspeed_shm_segments() -> set[Path]:
    return set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))


def _not_another_sessions(segments: set[Path]) -> set[Path]:
    """The segments that are not another test session's: a session beside this one (another pytest on the same
    machine) may be setting up its ranks, whose processes map their segments until they release the names."""
    if not segments:
        return segments
    mappers: dict[str, set[int]] = {}
    parents: dict[int, int] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            for line in (proc / "maps").read_text().splitlines():
                if "deepspeed_allreduce_buffer_" in line:
                    mappers.setdefault(line.rsplit(" ", 1)[-1].strip(), set()).add(int(proc.name))
        except (OSError, ValueError, IndexError):   # the process ended, or is not ours to read
            continue

    def ours(pid: int) -> bool:
        seen = set()
        while pid > 1 and pid not in seen:
            if pid == os.getpid():
                return True
            seen.add(pid)
            pid = parents.get(pid, 0)
        return False

    if any("pytest" in cmd and not ours(pid) and pid not in _ancestors(parents) for pid, cmd in _cmdlines()):
        # Another pytest session on this machine: a segment its ranks have created but not mapped yet (or have
        # just unmapped) cannot be told from ours, so only segments our own processes map are counted.
        return {path for path in segments if any(ours(pid) for pid in mappers.get(str(path), ()))}
    return {path for path in segments
            if not mappers.get(str(path)) or any(ours(pid) for pid in mappers[str(path)])}


def _ancestors(parents: dict[int, int]) -> set[int]:
    pid, seen = os.getppid(), set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        pid = parents.get(pid, 0)
    return seen


def _cmdlines():
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            yield int(proc.name), (proc / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            continue


@pytest.fixture(autouse=True)
def no_leaked_deepspeed_shm():
    """DeepSpeed's CPU communication op maps a 66 MB /dev/shm segment per rank and never unlinks it: memory lost
    until reboot. moe_scale never builds the op (moe_scale.distributed.launch.init_deepspeed_comm, which every path
    that initialises DeepSpeed takes); a test whose processes leave a segment behind fails here (and its segments
    are removed)."""
    before = _deepspeed_shm_segments()
    yield
    leaked = sorted(_not_another_sessions(_deepspeed_shm_segments() - before))
    for path in leaked:
        path.unlink(missing_ok=True)
    assert not leaked, (f"left DeepSpeed's all-reduce segments in /dev/shm: {[p.name for p in leaked]}; initialise "
                        "DeepSpeed through moe_scale.distributed.launch.init_deepspeed_comm")
