"""Every docs page but the reference tables (layout.md, shapes.md) opens, after its title and a one-paragraph intro,
with `## Common tasks`: one ```bash block of 3 to 6 one-line commands, each with a trailing `# comment`. This file
reads each block (tests/docs_code.py) and checks every command as written, in a fresh directory holding the
repository's ds_configs/, slurm/ and tools/ and the input files the commands name (INPUTS), on CPU:

- run to the end, exit status 0: `moe-scale plan`, `moe-scale flops` and every `--help`;
- run as written up to the trained run they read: `moe-scale eval`, `generate`, `export` and `prune-heads` run in
  that directory, which holds no trained run, and must stop at exactly one line, `--run DIR: no trained run
  there`: every flag and every check a command makes before it opens its run has passed (a flag that does not
  exist stops it at argparse, with another line);
- validated, not run (a run takes minutes): `moe-scale train` (and `python -m moe_scale train`) through the path
  `train` takes up to its data and model: the command's parser, `config_from_args` (the defaults, `--config` /
  `--resume` / `--preset`, every flag, the flags that do nothing for the model refused, `RunConfig.validate`),
  then the DeepSpeed JSON and the layout on its processes (`check_layout`, as `run_training` starts); where a
  command resumes or reloads a run (`--resume`, `--config`), the test first writes that run's config.json;
- `deepspeed ... --module moe_scale train ...`: the launcher's own flags through DeepSpeed's parser, then the
  train part as above, on the processes the launcher would start;
- `python tools/X.py ...`: the tool's own `parse_args` (its flags, and the checks it makes before any work);
- `bash tools/X.sh ...`: the script exists and parses (`bash -n`), and each `NAME=value` before it is a variable
  the script reads.

Commands that import torch or DeepSpeed run in forked children (tests/forked.py: about 0.1 s each, all of a page
at once); train's validation runs in this process.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from moe_scale.errors import UserError
from tests import forked
from tests.cli_runs import assert_one_line_error, cli_env, start_cli
from tests.docs_code import code_blocks, section
from tests.paths import REPO

PAGES = [page for page in sorted((REPO / "docs").glob("*.md")) if page.name not in ("layout.md", "shapes.md")]
TITLE = "Common tasks"
NEEDS_A_RUN = ("eval", "generate", "export", "prune-heads")
RUN_FULLY = ("plan", "flops")
LINKED = ("ds_configs", "slurm", "tools")   # what the commands read from the repository, by relative path
# The input files the Common tasks name, written into the fresh directory (a few sentences each).
INPUTS = ("train.txt", "valid.txt", "test.txt", "book.txt", "other_text.txt", "corpus/train.txt",
          "corpus/valid.txt", "corpus/test.txt", "shards/part-00.txt", "shards/part-01.txt", "wikitext-2/valid.txt",
          "wikitext-2/test.txt")
TEXT = "".join(f"the {w} said it would sell {n} shares .\n" for n in range(40) for w in ("company", "bank"))


# ---- reading the blocks -------------------------------------------------------------------------------------

def common_tasks(page: Path) -> list[str]:
    """The command lines of `page`'s Common tasks block, checked for the page's form on the way."""
    lines = page.read_text(encoding="utf-8").splitlines()
    where = page.name
    heading = f"## {TITLE}"
    assert heading in lines, f"{where}: no '{heading}'"
    at = lines.index(heading)
    assert lines[0].startswith("# ") and lines[1] == "" and lines[at - 1] == "", where
    assert not any(line.startswith("## ") for line in lines[:at]), f"{where}: {heading} is not the first section"
    intro = lines[2:at - 1]
    assert intro and all(line.strip() for line in intro), f"{where}: the title, one intro paragraph, then {heading}"
    blocks = code_blocks(section(page, TITLE), "bash")
    assert len(blocks) == 1, f"{where}: {len(blocks)} bash blocks under {heading}"
    commands = [line for line in blocks[0].splitlines() if line.strip()]
    assert 3 <= len(commands) <= 6, f"{where}: {len(commands)} common tasks (3 to 6)"
    for line in commands:
        assert not line.rstrip().endswith("\\"), f"{where}: one line per command: {line}"
        assert trailing_comment(line), f"{where}: no trailing '# comment': {line}"
    return commands


def trailing_comment(line: str) -> str:
    """The text of the line's `# comment` after its command (the first `#` after a space that the shell would
    take as a comment), or ''."""
    command = shlex.split(line, comments=True)
    for mark in re.finditer(r"\s#", line):
        try:
            if shlex.split(line[:mark.start()]) == command:
                return line[mark.end():].strip()
        except ValueError:   # the `#` is inside quotes
            continue
    return ""


def split_command(line: str) -> tuple[dict[str, str], list[str]]:
    """(`NAME=value`s before the program, the command's words), as the shell splits them (comment dropped)."""
    words = shlex.split(line, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


# ---- the workspace ------------------------------------------------------------------------------------------

def workspace(root: Path) -> Path:
    for name in LINKED:
        (root / name).symlink_to(REPO / name, target_is_directory=True)
    for name in INPUTS:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(TEXT, encoding="utf-8")
    return root


def _flag_value(words: list[str], flag: str) -> str | None:
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def write_runs_read(words: list[str], root: Path) -> None:
    """The config.json of a run a command reloads (`--config`) or resumes (`--resume --out`): the defaults'."""
    from moe_scale.config import RunConfig

    read = [_flag_value(words, "--config")] + ([_flag_value(words, "--out")] if "--resume" in words else [])
    for path in filter(None, read):
        file = root / path if path.endswith(".json") else root / path / "config.json"
        if not file.exists():
            config = RunConfig()
            config.run.out = str(file.parent.relative_to(root))
            file.parent.mkdir(parents=True, exist_ok=True)
            config.save(file)


@contextlib.contextmanager
def _working_directory(path: Path):
    here = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(here)


# ---- train: validated up to its data and model ----------------------------------------------------------------

def validate_train(argv: list[str], world: int) -> None:
    """`moe-scale ARGV` (ARGV[0] == "train") on `world` processes, through train's parser and checks up to its data
    and model; a refusal raises UserError with the line a user would see."""
    from moe_scale.cli import build_parser
    from moe_scale.commands.config_flags import config_from_args
    from moe_scale.layout.checks import check_layout
    from moe_scale.layout.ds_config import load_ds_config

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = build_parser().parse_args(argv)
    except SystemExit:
        raise UserError(said.getvalue().strip().splitlines()[-1]) from None
    assert args.command == "train", argv
    config = config_from_args(args)
    source = f"--ds-config {config.parallel.ds_config or '(built-in)'}"
    node = config.moe.dispatch.node_size or world
    check_layout(config, load_ds_config(config.parallel.ds_config), source, world, lambda: node)


def check_train_entry(argv: list[str]) -> int:
    """A forked child's entry: validate_train(ARGV[1:], int(ARGV[0])); exit status 2 and the error line if refused."""
    try:
        validate_train(argv[1:], int(argv[0]))
    except UserError as e:
        print(f"moe-scale: error: {e}", file=sys.stderr)
        return 2
    return 0


def check_launch_entry(argv: list[str]) -> int:
    """A forked child's entry: `deepspeed ARGV`, its flags through DeepSpeed's own parser, then the moe_scale train
    it would start, on the processes it would start."""
    from deepspeed.launcher.runner import parse_args

    args = parse_args(argv)
    if not (args.module and args.user_script == "moe_scale" and args.user_args[:1] == ["train"]):
        print(f"moe-scale: error: not a `--module moe_scale train` launch: {args.user_script} {args.user_args[:1]}",
              file=sys.stderr)
        return 2
    world = max(args.num_gpus, 1) * max(args.num_nodes, 1)
    return check_train_entry([str(world), *args.user_args])


def check_tool_entry(argv: list[str]) -> int:
    """A forked child's entry: `python ARGV` (ARGV[0] a tools/*.py) through the tool's own parse_args."""
    import importlib.util

    path = REPO / argv[0]
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    module.parse_args(argv[1:])   # a refused flag exits 2 with the tool's one line
    return 0


# ---- every command ------------------------------------------------------------------------------------------

def start(line: str, root: Path):
    """Starts the check of one documented command; returns (what to check its end against, the forked child) or
    (None, None) where it was checked here."""
    env_given, words = split_command(line)
    env = {**cli_env(), **env_given}
    if words[:3] == ["python", "-m", "moe_scale"]:
        words = ["moe-scale", *words[3:]]
    write_runs_read(words, root)
    if words[0] == "moe-scale":
        argv = words[1:]
        if argv[0] == "train" and not {"-h", "--help"} & set(argv):
            with _working_directory(root):
                validate_train(argv, 1)
            return None, None
        if argv[0] in NEEDS_A_RUN and not {"-h", "--help"} & set(argv):
            return f"--run {_flag_value(argv, '--run')}: no trained run there", start_cli(*argv, cwd=root, env=env)[0]
        assert argv[0] in RUN_FULLY or {"-h", "--help"} & set(argv), f"no check for `moe-scale {argv[0]}`"
        return 0, start_cli(*argv, cwd=root, env=env)[0]
    if words[0] == "deepspeed":
        return 0, forked.start(check_launch_entry, words[1:], root, env)
    if words[0] == "python" and words[1].startswith("tools/") and words[1].endswith(".py"):
        return 0, forked.start(check_tool_entry, words[1:], root, env)
    if words[0] == "bash" and words[1].startswith("tools/") and words[1].endswith(".sh"):
        script = REPO / words[1]
        assert script.is_file(), f"{words[1]}: no such script"
        parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert parsed.returncode == 0, parsed.stderr
        text = script.read_text(encoding="utf-8")
        unread = [name for name in env_given if not re.search(r"\$\{?" + name + r"\b", text)]
        assert not unread, f"{words[1]} reads no {unread}"
        return None, None
    raise AssertionError(f"no check for this program: {line}")


def check_page(page: Path, root: Path) -> None:
    """Every Common task of `page`, those in forked children all started at once; every failure is reported."""
    started, failures = [], []
    for line in common_tasks(page):
        try:
            expected, child = start(line, root)
        except (UserError, AssertionError) as e:
            failures.append(f"{line}\n    {e}")
            continue
        if child is not None:
            started.append((line, expected, child))
    for line, expected, child in started:
        child.wait(300)   # each to its own end (forked.wait_all stops the others at a first failure)
        proc = subprocess.CompletedProcess(child.args, child.returncode, child.stdout, child.stderr)
        try:
            if expected == 0:
                assert proc.returncode == 0, (proc.stderr or proc.stdout)[-2000:]
            else:
                assert_one_line_error(proc, expected)
        except AssertionError as e:
            failures.append(f"{line}\n    {e}")
    assert not failures, f"{page.name}: {len(failures)} common tasks fail as written:\n" + "\n".join(failures)


@pytest.mark.parametrize("page", PAGES, ids=[page.stem for page in PAGES])
def test_every_common_task_works_as_written(page, tmp_path):
    check_page(page, workspace(tmp_path))


def test_the_checks_catch_a_flag_that_does_not_exist_or_that_the_command_refuses(tmp_path):
    """The checks above fail on what they are for: `--ffn-hidden` is the transformer's (an LSTM's FFN is
    `--expert-hidden`), `--no-such-flag` exists nowhere, `--ep-size 2` needs 2 processes, eval has no `--steps`,
    a tool refuses an unknown model, and a page without its block is refused."""
    root = workspace(tmp_path)
    refused = {"moe-scale train --layout lstm-ffn-lstm --ffn-hidden 1024 --out runs/x": "--ffn-hidden does nothing",
               "moe-scale train --no-such-flag 1 --out runs/x": "unrecognized arguments: --no-such-flag",
               "moe-scale train --ep-size 2 --out runs/x": "--ep-size 2 does not divide the 1 processes"}
    for line, reason in refused.items():
        with pytest.raises(UserError, match=re.escape(reason)):
            start(line, root)
    started = [start(line, root)[1] for line in (
        "deepspeed --num_gpus 2 --module moe_scale train --ep-size 4 --out runs/x",
        "moe-scale eval --run runs/x --steps 3",
        "python tools/capacity_sweep.py --out runs/c --data train.txt --test-data test.txt --models moe-5")]
    for child, said in zip(started, ("--ep-size 4 does not divide the 2 processes",
                                     "unrecognized arguments: --steps", "--models: unknown moe-5")):
        assert child.wait(300) == 2 and said in child.stderr, child.stderr
    page = tmp_path / "page.md"
    page.write_text("# A page\n\nIts intro.\n\n## Usage\n\n## Common tasks\n\n```bash\nmoe-scale flops --list\n```\n")
    with pytest.raises(AssertionError, match="not the first section"):
        common_tasks(page)


def test_the_quieter_launches_of_clusters_md_take_the_launchers_own_flags(tmp_path):
    """docs/clusters.md's "Console output": the two launches that quiet the launcher's warnings (DS_ACCELERATOR,
    --log_level error; a hostfile with --no_ssh_check --master_addr) parse with DeepSpeed's launcher and train."""
    block = code_blocks(section(REPO / "docs" / "clusters.md", "Console output"), "bash")[-1]
    launches = [part.strip() for line in block.replace("\\\n", " ").splitlines() for part in line.split("&&")
                if " deepspeed " in f" {part} "]
    assert len(launches) == 2 and all("DS_ACCELERATOR=cpu" in line for line in launches), launches
    root = workspace(tmp_path)
    children = [start(line, root)[1] for line in launches]
    for line, child in zip(launches, children):
        assert child.wait(300) == 0, f"{line}\n{child.stderr[-2000:]}"
