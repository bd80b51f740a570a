"""The key-value store layer: its interface, the in-memory engine, the gRPC server and clients, etcd."""
