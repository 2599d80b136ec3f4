"""The metrics the docs name are the ones the service registers, with the same labels."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eplb_service.metrics import SERIES, Metrics

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("docs/service.md", "docs/rollout.md")
PACKAGES = {"eplb_service", "eplb_engine", "eplb_tools", "eplb_bench"}  # named in the same docs


def registered() -> dict[str, tuple[str, ...]]:
    """Series name as scraped (counters end in ``_total``) → label names, for the eplb_ series."""
    return {s.name: s.labels for s in SERIES.values()}


def families() -> dict[str, object]:
    """The eplb_ metric families a server's registry holds, by name as scraped."""
    out = {}
    for family in Metrics().registry.collect():
        if family.name.startswith("eplb_"):
            out[family.name + ("_total" if family.type == "counter" else "")] = family
    return out


def test_the_server_registers_every_series_of_the_catalogue_and_no_other():
    got = {name: (f.type, f.documentation) for name, f in families().items()}
    assert got == {s.name: (s.kind, s.help) for s in SERIES.values()}


def documented_table() -> dict[str, tuple[str, ...]]:
    """docs/service.md §Metrics: series → labels, from its table rows."""
    text = (ROOT / "docs/service.md").read_text()
    section = text[text.index("### Metrics") : text.index("### Logs")]
    rows = re.findall(r"^\| `(eplb_\w+)` \|([^|]*)\|", section, re.MULTILINE)
    return {name: tuple(re.findall(r"`(\w+)`", labels)) for name, labels in rows}


def test_the_metrics_table_lists_every_series_with_its_labels():
    assert documented_table() == registered()


@pytest.mark.parametrize("doc", DOCS)
def test_every_series_a_doc_names_exists(doc):
    text = (ROOT / doc).read_text()
    names = set(re.findall(r"`(eplb_\w+)[{`]", text)) - PACKAGES
    assert names, doc
    assert names <= set(registered()), sorted(names - set(registered()))
    for name, labels in re.findall(r"`(eplb_\w+)\{([^}]*)\}", text):
        used = set(re.findall(r"(\w+)=", labels) or re.findall(r"\w+", labels))
        assert used <= set(registered()[name]), (doc, name, used)


@pytest.mark.parametrize("doc", DOCS)
def test_every_test_file_a_doc_names_exists(doc):
    paths = re.findall(r"`(tests/[\w/]+\.py)", (ROOT / doc).read_text())
    assert all((ROOT / p).is_file() for p in paths), [p for p in paths if not (ROOT / p).is_file()]


def test_rollout_help_names_the_states_the_service_counts():
    # service/deployments.py counts these three; the help used to say "started, applied, aborted".
    source = (ROOT / "service/deployments.py").read_text()
    states = set(re.findall(r'\("(\w+)", rollout\.became_\w+', source))
    assert states == {"prepared", "switched", "failed"}
    help_text = families()["eplb_rollout_total"].documentation
    assert all(state in help_text for state in states), help_text
