"""The key schema is one table (eplb_service.redis_store.keys): the keys the store names come
from it, and the docs' table lists the same keys with the same types."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

from eplb_service.redis_store.keys import SCHEMA, DeploymentKey, Keys

DOCS = Path(__file__).resolve().parents[2] / "docs" / "service.md"


def test_every_fixed_deployment_key_is_in_the_table_and_deleted_with_the_deployment():
    table = {s.pattern for s in SCHEMA}
    assert {f"P:{{d}}:{what}" for what in get_args(DeploymentKey)} <= table
    fixed = Keys("P", cluster=False).fixed("d")
    assert fixed == [p for p in (s.pattern for s in SCHEMA) if p.startswith("P:{d}:") and "<" not in p]


def test_one_redis_has_one_index_and_feed_and_a_cluster_sixteen_buckets_each_in_its_slot():
    one, cluster = Keys("eplb", cluster=False), Keys("eplb", cluster=True)
    assert (one.index, one.feeds) == (["eplb:deployments"], ["eplb:feed"])
    assert len(cluster.index) == len(cluster.feeds) == 16
    assert cluster.index_of("d").replace(":deployments", "") == cluster.feed_of("d").replace(":feed", "")
    assert one.of("d", "meta") == "eplb:{d}:meta" and one.placement("d", 7) == "eplb:{d}:placement:7"


def test_the_docs_table_lists_the_schema():
    text = DOCS.read_text()
    section = text[text.index("## Redis key schema") :]
    rows = re.findall(r"^\| `(P[^`]*)` \| (\w+) \|", section, re.M)
    assert sorted(rows) == sorted((s.pattern, s.type) for s in SCHEMA)
