"""The subcommands beside the launch: `elasticrun <name>` is `commands/<name>.py`, whose `register()` adds it."""
