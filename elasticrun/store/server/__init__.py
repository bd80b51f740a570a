"""The built-in store: its in-memory engine, and the gRPC server that serves it.

`store_server.StoreServer` is the server; the engine (`memory.MemoryStore`) also serves
`--standalone` runs directly. No client imports anything here.
"""
