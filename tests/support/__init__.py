"""What the tests share: clusters, stores, certificates, waits and helpers (conftest.py loads the fixtures)."""
