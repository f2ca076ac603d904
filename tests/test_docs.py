"""The documentation stays findable: no page over 25,000 bytes (README.md over 13,000), and every relative link
`[text](path)` or `[text](path#anchor)` in README.md, CHANGELOG.md, docs/*.md, tools/README.md and tests/README.md
reaches an existing file and, with an anchor, a heading of that file whose GitHub slug is the anchor. And what the
docs compute holds: docs/capacity.md's dense widths that match an MoE, and its table of the sweep's models, against
the counts `moe-scale flops` uses and the modules' own parameters; training.md's run-start line against a model's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs_code import section
from tests.paths import REPO

PAGE_LIMIT = 25_000
README_LIMIT = 13_000
FENCE = re.compile(r"^ {0,3}(```|~~~)")
LINK = re.compile(r"(?<!\\)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(([^()\s]*)\)")


def pages() -> list[Path]:
    return sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md", REPO / "CHANGELOG.md"]


def linking_pages() -> list[Path]:
    return pages() + [REPO / "tools" / "README.md", REPO / "tests" / "README.md"]


def without_fences(markdown: str) -> str:
    """`markdown` with the lines of its fenced code blocks blanked (kept as empty lines, so line numbers hold)."""
    kept, fence = [], None
    for line in markdown.split("\n"):
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
            kept.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            kept.append("")
        else:
            kept.append(line)
    return "\n".join(kept)


def prose(markdown: str) -> str:
    """`markdown` without its fenced code blocks and inline code spans: the text whose links a reader follows."""
    return re.sub(r"(`+)[^`](?:(?!\n\s*\n).)*?\1", "", without_fences(markdown), flags=re.S)   # not past a paragraph


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: its rendered text (markdown links, code marks and emphasis gone)
    lowercased, every character but letters, digits, '_', '-' and spaces dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"<[^>]*>", "", text)
    text = re.sub(r"[`*]", "", text).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The anchors of a page's ATX headings, with GitHub's -1, -2, ... for repeated ones."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in without_fences(markdown).split("\n"):
        heading = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(markdown: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link outside code; a link's text may run over a line break."""
    text = prose(markdown)
    return [(text.count("\n", 0, match.start()) + 1, match.group(2)) for match in LINK.finditer(text)]


def broken_links(page: Path) -> list[str]:
    problems = []
    for number, target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or not target:   # http(s), mailto, ...
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(REPO).as_posix()}:{number}: {target}"
        if not destination.exists():
            problems.append(f"{where}: no such file")
        elif anchor and destination.is_file() and destination.suffix == ".md":
            if anchor not in anchors(destination.read_text(encoding="utf-8")):
                problems.append(f"{where}: no heading with that anchor")
        elif anchor and not destination.is_file():
            problems.append(f"{where}: an anchor into a directory")
    return problems


def test_no_page_is_over_the_limit():
    sizes = {page: page.stat().st_size for page in pages()}
    limits = {page: README_LIMIT if page.name == "README.md" and page.parent == REPO else PAGE_LIMIT for page in sizes}
    over = [f"{page.relative_to(REPO).as_posix()}: {size:,} bytes (limit {limits[page]:,})"
            for page, size in sizes.items() if size > limits[page]]
    assert not over, "split these pages by topic:\n" + "\n".join(over)


def test_every_relative_link_reaches_a_file_and_a_heading():
    for page in linking_pages():
        assert page.is_file(), page
    problems = [problem for page in linking_pages() for problem in broken_links(page)]
    assert not problems, f"{len(problems)} broken links:\n" + "\n".join(problems)


def test_slugs_are_githubs():
    assert slug("Streaming (100B words)") == "streaming-100b-words"
    assert slug("Memory (App. D)") == "memory-app-d"
    assert slug("Several processes, expert parallelism, ZeRO") == "several-processes-expert-parallelism-zero"
    assert slug("Against the paper's K40 clusters") == "against-the-papers-k40-clusters"
    contract = "The DeepSpeed contract (`moe/deepspeed_adapter.py`)"
    assert slug(contract) == "the-deepspeed-contract-moedeepspeed_adapterpy"
    assert slug("Transformer LMs: MHA, MoA, MAE") == "transformer-lms-mha-moa-mae"
    assert slug("Tables 7 and 8 -- presets") == "tables-7-and-8----presets"   # each space a '-', none merged
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## B `c`\n") == {"a", "a-1", "b-c"}


def test_links_are_found_where_a_reader_sees_them():
    text = "see [a](x.md#y) and [b\nc](z.md)\n```\n[not](code.md)\n```\n`[nor](this.md)` [d](https://e.f)\n"
    assert links(text) == [(1, "x.md#y"), (1, "z.md"), (6, "https://e.f")]


# ---- docs/capacity.md: a dense FFN matched to an MoE ------------------------------------------------------------

def _counts(settings: dict) -> tuple[int, int, int]:
    """(ops/timestep, parameters without embedding and softmax as accounting/flops.py counts them, the same counted
    from the module built on the meta device) of an LSTM LM."""
    from moe_scale.accounting.flops import lstm_lm_accounting
    from moe_scale.config import RunConfig
    from moe_scale.models.meta_build import build_lstm_lm_on_meta, parameters_per_child

    config = RunConfig.from_settings(**settings)
    counted = lstm_lm_accounting(config, 1000)
    module = parameters_per_child(build_lstm_lm_on_meta(config, 1000))
    return (counted.ops_per_timestep, counted.params_excluding_embedding_softmax,
            sum(module.values()) - module["embedding"] - module["softmax"])


def _moe(d: int, experts: int, k: int, hidden: int, groups: int = 0) -> dict:
    """An MoE LSTM LM's settings: flat top-k, or hierarchical with `groups` groups and k = 2 x (k // 2)."""
    settings = {"d_model": d, "num_experts": experts, "top_k": k, "expert_hidden": hidden}
    if groups:
        settings.update(gate="hierarchical", num_groups=groups, top_k=2, top_k_secondary=k // 2)
    return settings


def dense_width(experts: int, k: int, hidden: int, groups: int = 0, same: str = "compute") -> int:
    """docs/capacity.md's formulas: the dense FFN width with an MoE's ops/timestep or its parameters."""
    if same == "compute":
        return k * hidden + (groups + 2 * experts // groups if groups else experts)   # k_p = 2 chosen groups
    return experts * hidden + (groups + experts if groups else experts)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("experts, k, hidden, groups", [(4, 4, 255, 0), (32, 4, 248, 0), (16, 2, 96, 0),
                                                        (256, 4, 244, 16), (64, 4, 40, 8)])
def test_capacity_dense_width_formulas_match_the_counts(d, experts, k, hidden, groups):
    moe = _counts(_moe(d, experts, k, hidden, groups))
    for same, index in (("compute", 0), ("parameters", 1)):
        width = dense_width(experts, k, hidden, groups, same)
        dense = _counts({"d_model": d, "layout": "lstm-ffn-lstm", "expert_hidden": width})
        assert dense[index] == moe[index], (same, width, dense, moe)
        if same == "parameters":
            assert dense[2] == moe[2], (width, dense, moe)   # the modules' own parameters too


def test_capacity_table_is_the_formula_and_the_counts():
    """Each row of capacity.md's table at d = 128 (dense FFN 1024 wide): the experts' width the compute formula
    gives, and the parameters counted."""
    rows = re.findall(r"^\| (dense \(lstm-ffn-lstm\)|4xlstm|MoE-\d+(?:-h)?) \| (\d+) \| ([\d,]+) \|$",
                      section(REPO / "docs" / "capacity.md", "What it trains"), flags=re.M)
    assert len(rows) == 9, rows
    from moe_scale.accounting.flops import lstm_lm_accounting
    from moe_scale.config import RunConfig

    for name, width, params in rows:
        if name.startswith("dense"):
            settings = {"d_model": 128, "layout": "lstm-ffn-lstm", "expert_hidden": int(width)}
            assert int(width) == 8 * 128
        elif name == "4xlstm":
            settings = {"d_model": 128, "layout": "4xlstm", "lstm_hidden": int(width)}
        else:
            experts = int(name.split("-")[1])
            groups = round(experts ** 0.5) if name.endswith("-h") else 0
            assert int(width) == round((1024 - dense_width(experts, 4, 0, groups)) / 4), name   # solved for h_e
            settings = _moe(128, experts, 4, int(width), groups)
        counted = lstm_lm_accounting(RunConfig.from_settings(**settings), 1000)
        assert counted.params_excluding_embedding_softmax == int(params.replace(",", "")), name


def test_the_run_start_line_says_experts_per_layer_times_layers_as_training_md_shows():
    """training.md's start line: `(… in 8 experts × 2 layers)`, never the product (16 experts) for 2 layers of 8."""
    from moe_scale.config import RunConfig
    from moe_scale.models.build import build_model
    from moe_scale.models.build import describe_parameters

    shown = section(REPO / "docs" / "training.md", "The log line and efficiency numbers")
    experts, layers = map(int, re.search(r"`training [\d.]+M parameters \([\d.]+M in (\d+) experts × (\d+) layers\) "
                                         r"on 1 process\(es\), \.\.\.`", shown).groups())
    config = RunConfig.from_settings(model="transformer", ffn="moe", num_layers=layers, num_experts=experts,
                                     d_model=16, expert_hidden=16, num_heads=2)
    line = describe_parameters(build_model(config, 50, ep_size=1, ep_rank=0, seed=1))
    assert line.endswith(f"in {experts} experts × {layers} layers)") and f"in {experts * layers} " not in line, line
    moa = RunConfig.from_settings(model="transformer", attention="moa", moa_num_experts=4, moa_top_k=2, ffn="moe",
                                  num_layers=2, num_experts=8, d_model=16, expert_hidden=16)
    line = describe_parameters(build_model(moa, 50, ep_size=1, ep_rank=0, seed=1))
    assert line.endswith("in 4 attention experts × 2 layers + 8 experts × 2 layers)"), line
    lstm = describe_parameters(build_model(RunConfig.from_settings(d_model=16, expert_hidden=16), 50, ep_size=1,
                                           ep_rank=0, seed=1))
    assert lstm.endswith("in 16 experts)"), lstm   # one layer: as tools/table6.py reads it
