"""`moe-scale export`: a trained run as a model directory other tools load (--format hf: HuggingFace
transformers, with remote code, safetensors weights and a word-level tokenizer; a --block llama run as
transformers' own Mixtral / Llama classes)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from moe_scale.commands.help_format import HelpFormatter
from moe_scale.commands.run_flags import add_run_flags

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
    p.set_defaults(run_command=run)


def run(args: argparse.Namespace) -> None:
    from moe_scale.inference.hf_export import check_target, export_hf

    out = Path(args.out)
    check_target(out)   # before the slow imports
    with contextlib.redirect_stdout(sys.stderr):
        tag = export_hf(Path(args.run), out, args.checkpoint)
    import json

    native = json.loads((out / "config.json").read_text())["architectures"][0] != "MoEScaleForCausalLM"
    print(f"exported {args.run} ({tag}) to {out}: AutoModelForCausalLM.from_pretrained({str(out)!r}"
          + (")" if native else ", trust_remote_code=True)"))
