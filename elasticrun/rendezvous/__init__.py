"""The rendezvous protocol over a small key-value store interface, and its stores."""
