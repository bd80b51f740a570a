"""The rendezvous protocol: records, the pure round decision, the leader, the elastic and static handlers."""
