"""Each mechanism's module docstring and docs/guide.md#references link the paper or PR it comes from.

The links are a fixed list here, each one confirmed by hand against the peers' pages and the
papers: a link in a module docstring or in the guide's References section that is not on the
list is a typo (or a new source, to add here after checking it). The docstrings are read with
``ast`` (no import).
"""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "nemo_rs_plugin" / "core"
GUIDE = REPO / "docs" / "guide.md"

#: Every source the plugin cites, by the name the docs use for it.
LINKS = {
    "GSPO": "https://arxiv.org/abs/2507.18071",
    "CISPO": "https://arxiv.org/abs/2506.13585",
    "KL estimators": "http://joschu.net/blog/kl-approx.html",
    "TIS": "https://fengyao.notion.site/off-policy-rl",
    "IcePop": "https://ringtech.notion.site/icepop",
    "Ring-1T": "https://arxiv.org/abs/2510.18855",
    "Geo-RS": (
        "https://yingru.notion.site/When-Speed-Kills-Stability-Demystifying-RL-Collapse-from-the-"
        "Training-Inference-Mismatch-271211a558b7808d8b12d403fd15edda"
    ),
    "VERL rollout correction": "https://verl.readthedocs.io/en/latest/algo/rollout_corr.html",
    "OPSM": "https://arxiv.org/abs/2512.02556",
    "DPPO": "https://arxiv.org/abs/2602.04879",
    "prime-rl": "https://docs.primeintellect.ai/prime-rl/algorithms",
    "IPO": "https://docs.primeintellect.ai/prime-rl/ipo.md",
    "NeMo-RL PR #2269": "https://github.com/NVIDIA-NeMo/RL/pull/2269",
    "NeMo-RL PR #1899": "https://github.com/NVIDIA-NeMo/RL/pull/1899",
    "SkyRL PR #849": "https://github.com/NovaSky-AI/SkyRL/pull/849",
    "AReaL PR #1088": "https://github.com/inclusionAI/AReaL/pull/1088",
    "AReaL PR #1218": "https://github.com/inclusionAI/AReaL/pull/1218",
    "TRL PR #4891": "https://github.com/huggingface/trl/pull/4891",
}
ALLOWED = set(LINKS.values())

#: What the rejection filters take from their sources (the config side and the tensor side alike).
FILTERS = ["Geo-RS", "IcePop", "AReaL PR #1088", "AReaL PR #1218", "SkyRL PR #849", "OPSM", "DPPO", "prime-rl", "IPO"]
#: The modules that implement a mechanism, and the sources each must link.
MODULES = {
    "policy_loss.py": ["GSPO", "CISPO", "KL estimators"],
    "registries/is_levels.py": ["NeMo-RL PR #2269", "GSPO", "SkyRL PR #849"],
    "correction/weights.py": ["NeMo-RL PR #2269"],  # the truncation types: cited in truncation.py
    "registries/truncation.py": ["TIS", "IcePop", "NeMo-RL PR #1899", "Geo-RS"],
    "registries/aggregations.py": ["Geo-RS", "AReaL PR #1088"],
    "correction/statistics.py": ["GSPO", "Geo-RS"],
    "correction/filters.py": FILTERS,
    "settings/rejection_filter.py": FILTERS,
    "registries/filter_statistics.py": [
        "KL estimators",
        "AReaL PR #1088",
        "VERL rollout correction",
        "Geo-RS",
        "DPPO",
        "IPO",
    ],
    "settings/presets.py": [
        "Geo-RS",
        "VERL rollout correction",
        "SkyRL PR #849",
        "NeMo-RL PR #2269",
        "IcePop",
        "TIS",
        "DPPO",
    ],
}

#: The guide's References section names each of these with its link.
GUIDE_ENTRIES = {
    "GSPO": ["GSPO"],
    "TIS": ["TIS"],
    "IcePop": ["IcePop", "Ring-1T"],
    "Geo-RS": ["Geo-RS"],
    "seq-mask-tis in NeMo-RL": ["NeMo-RL PR #1899"],
    "VERL rollout correction": ["VERL rollout correction"],
    "OPSM": ["OPSM"],
    "DPPO": ["DPPO", "prime-rl"],
    "IPO": ["IPO"],
    "CISPO": ["CISPO"],
    "k1/k2/k3": ["KL estimators"],
    "NeMo-RL PR #2269": ["NeMo-RL PR #2269"],
    "SkyRL PR #849": ["SkyRL PR #849"],
    "AReaL PR #1088": ["AReaL PR #1088"],
    "AReaL PR #1218": ["AReaL PR #1218"],
    "TRL PR #4891": ["TRL PR #4891"],
}

URL = re.compile(r"https?://[^\s<>()\[\]`\"']+")


def links(text: str) -> list[str]:
    return [u.rstrip(".,;:") for u in URL.findall(text)]


def module_docstring(rel: str) -> str:
    doc = ast.get_docstring(ast.parse((CORE / rel).read_text()))
    assert doc, f"nemo_rs_plugin/core/{rel} has no module docstring"
    return doc


def guide_references() -> str:
    guide = GUIDE.read_text()
    assert "\n## References\n" in guide, "docs/guide.md has no '## References' section"
    section = guide.split("\n## References\n", 1)[1]
    return section.split("\n## ", 1)[0]


def test_the_fixed_list_is_well_formed():
    assert len(ALLOWED) == len(LINKS), "two names share a link"
    for name, url in LINKS.items():
        assert links(url) == [url], (name, url)


@pytest.mark.parametrize("rel", sorted(MODULES))
def test_each_mechanism_module_links_its_sources(rel):
    doc = module_docstring(rel)
    found = links(doc)
    assert found, f"nemo_rs_plugin/core/{rel}: no http(s) link in the module docstring"
    assert "References:" in doc, f"nemo_rs_plugin/core/{rel}: no References: block"
    unknown = [u for u in found if u not in ALLOWED]
    assert not unknown, f"nemo_rs_plugin/core/{rel}: links not in the fixed list (a typo?): {unknown}"
    missing = [name for name in MODULES[rel] if LINKS[name] not in found]
    assert not missing, f"nemo_rs_plugin/core/{rel}: the References block does not link {missing}"


def test_the_guides_references_name_each_source_with_its_link():
    section = guide_references()
    unknown = [u for u in links(section) if u not in ALLOWED]
    assert not unknown, f"docs/guide.md#references: links not in the fixed list (a typo?): {unknown}"
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    for entry, names in GUIDE_ENTRIES.items():
        row = next((r for r in rows if r.startswith(f"| {entry} |") or r.startswith(f"| {entry},")), None)
        assert row is not None, f"docs/guide.md#references has no row for {entry}"
        for name in names:
            assert LINKS[name] in links(row), f"docs/guide.md#references: the {entry} row does not link {LINKS[name]}"


def test_the_guides_inline_links_are_references():
    """An external link elsewhere in the guide points to a source its References section lists."""
    guide = GUIDE.read_text()
    listed = set(links(guide_references()))
    elsewhere = [u for u in links(guide) if u not in listed]
    assert not elsewhere, f"docs/guide.md links sources its References section does not list: {elsewhere}"
