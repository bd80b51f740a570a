"""A worker that does nothing: the launcher's own cost, end to end."""
