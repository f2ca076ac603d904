"""docs/using-a-run.md's export section runs as written (issue 41): its command from a directory without exported/,
its Python as shown (no interactive prompt under transformers 5), and the per-word perplexity its code prints is
`moe-scale eval --data`'s on the same text. The commands and code are read from the markdown, so this test
follows the docs. README.md's export commands, if it shows any, are among the section's."""

from __future__ import annotations

import pytest

from tests.cli_runs import run_cli, run_eval
from tests.docs_code import code_blocks, commands, run_python, section
from tests.paths import REPO
from tests.wikitext import wikitext_sentences

DOCS = REPO / "docs" / "using-a-run.md"
EXPORT_SECTION = "Exporting to HuggingFace transformers"


def _export_commands(markdown: str) -> list[list[str]]:
    return [c for block in code_blocks(markdown, "bash") for c in commands(block, "moe-scale") if c[1] == "export"]


@pytest.mark.slow
def test_the_documented_export_runs_as_written(tmp_path, lstm_run, embedded_cache):
    text = section(DOCS, EXPORT_SECTION)
    shown = _export_commands(text)
    assert shown and all(c in shown for c in _export_commands((REPO / "README.md").read_text()))
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "lstm-moe").symlink_to(lstm_run)   # read only: export and eval write nothing there
    (tmp_path / "other_text.txt").write_text("\n".join(wikitext_sentences("test")[:40]) + "\n", encoding="utf-8")
    for command in shown:
        run_cli(*command[1:], cwd=tmp_path, cache=embedded_cache, check=True)
    assert (tmp_path / "exported" / "lstm-moe" / "model.safetensors").is_file()

    loading, perplexity = code_blocks(text, "python")
    generated = run_python(loading, tmp_path).splitlines()[-1].split()   # (a library may log to stdout before)
    assert generated[0] == "<S>" and len(generated) > 4
    printed = run_python(perplexity, tmp_path).splitlines()[-1]
    assert printed.startswith("perplexity per word: ")
    evaluated = run_eval(["--run", "runs/lstm-moe", "--data", "other_text.txt"], cwd=tmp_path, cache=embedded_cache)
    assert float(printed.split(":")[1]) == pytest.approx(evaluated["ppl"], rel=1e-4)
