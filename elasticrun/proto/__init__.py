"""The store service definition and its generated stubs."""
