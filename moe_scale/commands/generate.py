"""`moe-scale generate`: text from a trained run, in one process on CPU or GPU.

    moe-scale generate --run DIR [--prompt TEXT | --prompt-file PATH] [--max-new-tokens 30] [--num-samples 1]
                       [--temperature 1.0] [--top-k 0] [--top-p 1.0] [--greedy] [--seed 0] [--show-experts]

A sample starts after <S> (and the prompt) and ends at </S> or after --max-new-tokens tokens (words, or BPE
pieces for a run trained with --tokenizer bpe or a tokenizer.json); words outside a word vocabulary show as <unk>.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from moe_scale.commands.help_format import HelpFormatter
from moe_scale.commands.run_flags import add_run_flags
from moe_scale.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("generate", formatter_class=HelpFormatter,
                       help="sample text from a trained run (LSTM or transformer), word by word",
                       description="Sample text from a trained run (LSTM or transformer) in one process: the "
                                   "prompt continued word by word (BPE piece by piece) until its sentence ends or "
                                   "--max-new-tokens; --show-experts adds the experts each word was routed to.")
    add_run_flags(p, "sample from")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="TEXT", help="words to continue (default: start a sentence)")
    prompt.add_argument("--prompt-file", metavar="PATH", help="read the prompt from this UTF-8 file")
    p.add_argument("--max-new-tokens", type=int, default=30, help="words per sample at most (a sample also ends "
                                                                  "at the end of its sentence)")
    p.add_argument("--num-samples", type=int, default=1, help="samples drawn together")
    p.add_argument("--temperature", type=float, default=1.0, help="divides the log-probabilities (<1: safer)")
    p.add_argument("--top-k", type=int, default=0, help="draw only among the k most likely words (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="draw only among the most likely words whose "
                                                            "probabilities sum to p (nucleus sampling)")
    p.add_argument("--greedy", action="store_true", help="always the most likely word (no sampling)")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives the same samples")
    p.add_argument("--record-routes", metavar="DIR", help="write each routed layer's chosen experts per token of "
                                                          "every decoding step to DIR (docs/routing.md)")
    p.add_argument("--show-experts", action="store_true", help="per generated word: the experts (and gates) "
                                                               "it was routed to in every expert layer")
    p.set_defaults(run_command=run)


def run(args: argparse.Namespace) -> None:
    from moe_scale.inference.sampling import SamplingConfig

    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, greedy=args.greedy)
    sampling.validate()
    if args.max_new_tokens < 1 or args.num_samples < 1:
        raise UserError(f"--max-new-tokens and --num-samples must be at least 1 (got {args.max_new_tokens} and "
                        f"{args.num_samples})")
    prompt = _prompt_words(args.prompt, args.prompt_file)
    with contextlib.redirect_stdout(sys.stderr):   # only the samples on stdout
        text, note = run_generate(Path(args.run), prompt, args.max_new_tokens, args.num_samples, sampling,
                                  args.seed, args.show_experts, args.checkpoint, args.record_routes)
    print(text, flush=True)
    if note is not None:
        print(f"moe-scale: {note}", file=sys.stderr)


def _prompt_words(prompt: str | None, prompt_file: str | None) -> list[str]:
    if prompt_file is None:
        return (prompt or "").split()
    from moe_scale.data.text import not_utf8_error, unreadable_error

    path = Path(prompt_file)
    try:
        return path.read_text(encoding="utf-8").split()
    except FileNotFoundError:
        raise UserError(f"--prompt-file {prompt_file}: no such file; check the path") from None
    except UnicodeDecodeError as e:
        raise not_utf8_error(path, e.start) from None
    except OSError as e:
        raise unreadable_error(path, e) from None


def run_generate(run: Path, prompt: list[str], max_new: int, num_samples: int, sampling, seed: int,
                 show_experts: bool, checkpoint: str | None, record_routes: str | None = None
                 ) -> tuple[str, str | None]:
    """(the samples as printed, a note where some ended their sentence before any new token)."""
    from moe_scale.inference.trained_run import open_trained_run

    text = " ".join(prompt)
    trained = open_trained_run(run, checkpoint, "generate", check=lambda config, tokenizer: _check_context(
        config, len(tokenizer.encode(text)), max_new, show_experts))
    import torch

    from moe_scale.inference.generate import ended_at_once, format_samples, generate

    tokenizer = trained.tokenizer
    prompt_ids = tokenizer.encode(text)
    generator = torch.Generator().manual_seed(seed)
    from moe_scale.moe.route_tape import open_tape

    config, env = trained.config, trained.env
    tape = open_tape(trained.model.moe_layers(), config.moe.router.gate, record_routes, None, env.rank,
                     env.world_size, {"prompt": prompt_ids, "samples": num_samples, "seed": seed})
    samples = generate(trained.model, tokenizer, prompt_ids, num_samples, max_new, sampling, generator,
                       trained.env.device, show_experts, tape)
    return format_samples(tokenizer, prompt_ids, samples, show_experts), ended_at_once(samples, sampling.greedy)


def _check_context(config, prompt_tokens: int, max_new: int, show_experts: bool) -> None:
    """A transformer's <S>, prompt and new tokens must fit the context it was trained with."""
    if config.model.kind != "transformer":
        return
    unit = "words" if config.data.tokenizer == "words" else "tokens"
    context, used = config.data.seq_len, 1 + prompt_tokens   # <S> + the prompt
    if used > context:
        raise UserError(f"the prompt ({prompt_tokens} {unit} after <S>) is longer than the model's context of "
                        f"{context} positions (--seq-len it was trained with); shorten it")
    fed = max_new if show_experts else max_new - 1   # the last token is read back only to show its routing
    if used + fed > context:
        raise UserError(f"<S>, the {prompt_tokens}-{unit[:-1]} prompt and --max-new-tokens {max_new} need "
                        f"{used + fed} positions, more than the model's context of {context}; "
                        f"pass --max-new-tokens {context - used + max_new - fed} or less")
