"""`moe-scale export`: a trained run as a model directory other tools load (--format hf: HuggingFace
transformers, with remote code, safetensors weights and a word-level tokenizer; a --block llama run as
transformers' own Mixtral / Qwen2-MoE / Qwen3-MoE / Llama / Qwen3 classes), in one safetensors file or, past
--max-shard-size, in shards with an index."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from moe_scale.commands.help_format import HelpFormatter
from moe_scale.commands.run_flags import add_run_flags
from moe_scale.errors import UserError

def add_parser(sub) -> None:
    p = sub.add_parser("export", help="a trained run as a HuggingFace transformers model directory",
                       description="Write a trained run as a HuggingFace transformers model directory (remote code, "
                                   "safetensors weights, a word-level tokenizer) that AutoModelForCausalLM."
                                   "from_pretrained(DIR, trust_remote_code=True) loads.",
                       formatter_class=HelpFormatter)
    add_run_flags(p, "export")
    p.add_argument("--format", choices=("hf",), default="hf", help="hf: transformers' from_pretrained (with "
                                                                 "trust_remote_code=True, but a --block llama run: "
                                                                 "a native MixtralForCausalLM / LlamaForCausalLM)")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to create (must not exist; missing "
                                                             "parents are created)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="weights past SIZE (bytes, or with KB/MB/GB or KiB/MiB/GiB) go to several safetensors files "
                        "and an index, as transformers' save_pretrained writes them (default 5GB)")
    p.set_defaults(run_command=run)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """--max-shard-size: bytes, or a number with KB/MB/GB (powers of 1000) or KiB/MiB/GiB (of 1024)."""
    number = text.strip().rstrip("bBiIkKmMgG")
    unit = text.strip()[len(number):].upper()
    try:
        size = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        size = 0
    if not 1 <= size < float("inf"):
        raise UserError(f"--max-shard-size {text}: give a size such as 5GB, 500MB or 2000000 (bytes)")
    return int(size)


def run(args: argparse.Namespace) -> None:
    from moe_scale.inference.hf_export import check_target, export_hf

    out = Path(args.out)
    max_shard_bytes = parse_size(args.max_shard_size)
    check_target(out)   # before the slow imports
    with contextlib.redirect_stdout(sys.stderr):
        tag = export_hf(Path(args.run), out, args.checkpoint, max_shard_bytes)
    import json

    native = json.loads((out / "config.json").read_text())["architectures"][0] != "MoEScaleForCausalLM"
    print(f"exported {args.run} ({tag}) to {out}: AutoModelForCausalLM.from_pretrained({str(out)!r}"
          + (")" if native else ", trust_remote_code=True)"))
