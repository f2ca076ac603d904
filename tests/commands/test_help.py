"""Every `moe-scale COMMAND --help` page, as a user gets it: a description under the usage, and each option's
default at most once, never "(default: None)" (moe_scale/commands/help_format.py)."""

from __future__ import annotations

import argparse
import re

import pytest

from moe_scale.cli import commands
from moe_scale.commands.help_format import HelpFormatter, with_default
from tests.cli_runs import run_cli

NAMES = ["train", "eval", "generate", "export", "flops", "plan", "prune-heads"]


def option_entries(page: str) -> dict[str, str]:
    """Option -> its help text on the page, wrapped lines joined by single spaces."""
    entries: dict[str, str] = {}
    current = None
    for line in page.splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif current is not None and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return {option: " ".join(text.split()) for option, text in entries.items()}


def test_every_command_is_checked():
    assert len(NAMES) == len(commands())


@pytest.mark.parametrize("name", NAMES)
def test_the_help_page_has_a_description_and_each_default_once(tmp_path, name):
    proc = run_cli(name, "--help", cwd=tmp_path, check=True)
    page = proc.stdout
    assert page.startswith(f"usage: moe-scale {name} ") and proc.stderr == ""
    description = page.split("\n\n")[1]
    assert not description.startswith(("options:", "positional arguments:")), page
    assert len(description.split()) >= 10, description
    entries = option_entries(page)
    assert "-h" in entries and len(entries) >= 4
    for option, text in entries.items():
        assert text.count("(default") <= 1, f"{option}: {text}"
        assert "(default: None)" not in text, text
        if "--no-" not in text:   # a flag's False is no default worth a word; --x/--no-x names which is on
            assert "(default: False)" not in text, text


def test_defaults_are_added_only_where_they_say_something():
    assert with_default("steps", 10) == "steps (default: 10)"
    assert with_default("the file (default: none given)", "x.json") == "the file (default: none given)"
    assert with_default("the run's preset", None) == "the run's preset"
    parser = argparse.ArgumentParser(prog="p", formatter_class=HelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="steps")
    parser.add_argument("--data", help="text (default: the run's validation split)")
    parser.add_argument("--run", required=True, help="run directory")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--noise", action=argparse.BooleanOptionalAction, default=True, help="noisy gates")
    parser.add_argument("--rate", type=float, default=0.5, help="a share of 50%%")
    entries = option_entries(parser.format_help())
    assert entries["--steps"].endswith("steps (default: 10)")
    assert entries["--data"].endswith("text (default: the run's validation split)")
    assert entries["--run"].endswith("run directory") and entries["--json"].endswith("print JSON")
    assert entries["--noise"].endswith("noisy gates (default: True)")
    assert entries["--rate"].endswith("a share of 50% (default: 0.5)")
    assert re.search(r"\(default", entries["--run"] + entries["--json"]) is None


def test_train_help_groups_its_flags_model_moe_data_parallel_run_the_common_ones_first():
    """`moe-scale train --help`: the config sections in the order a user reads a run (moe_scale/commands/
    config_flags.py's SECTION_ORDER), each opening with the flags most runs set, every setting once."""
    from moe_scale.cli import build_parser
    from moe_scale.config import RunConfig

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    page = subparsers.choices["train"].format_help()
    sections = re.findall(r"^(\w+) settings:$", page, flags=re.M)
    assert sections == ["model", "moe", "attention", "softmax", "data", "train", "parallel", "run"], sections
    groups = {title: re.findall(r"^  (--[\w-]+)", body, flags=re.M)
              for title, body in re.findall(r"^(\w+) settings:\n(.*?)(?=^\S|\Z)", page, flags=re.M | re.S)}
    opening = {"model": ["--model", "--d-model", "--layout", "--num-layers"],
               "moe": ["--num-experts", "--top-k", "--expert-hidden", "--gate"],
               "data": ["--data", "--tokenizer", "--vocab-size", "--seq-len"],
               "train": ["--batch-size", "--max-steps", "--lr"],
               "parallel": ["--ep-size", "--ds-config"], "run": ["--out", "--resume", "--overwrite"]}
    for section, flags in opening.items():
        assert groups[section][:len(flags)] == flags, (section, groups[section])
    listed = [flag for flags in groups.values() for flag in flags]
    assert sorted(listed) == sorted(leaf.flag for leaf in RunConfig.leaves().values())
