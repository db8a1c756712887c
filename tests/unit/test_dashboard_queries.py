"""The PromQL reader the end-to-end dashboard check (tests/e2e/test_deploy_server.py) relies on."""

from __future__ import annotations

from tests.fixtures.deploy import query_names


def test_query_parser_finds_names_and_labels():
    names, labels = query_names(
        '1 + sum by (method) (rate(a_total{model="x",instance=~"$i"}[5m])) '
        '/ on (method) group_left sum(rate(b{z!="1"}[1m]))'
    )
    assert names == {"a_total", "b"} and labels == {"method", "model", "instance", "z"}
