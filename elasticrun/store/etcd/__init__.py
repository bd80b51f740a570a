"""The etcd v3 backend of the Store interface (`--rdzv-backend=etcd`), and etcd's roles."""
