"""Shared test fixtures. Fixture modules of each area are plugged in here."""

pytest_plugins: list[str] = ["tests.etcd_support", "tests.elastic_cluster"]
