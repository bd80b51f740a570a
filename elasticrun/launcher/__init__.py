"""Command line: torchrun-compatible flags, subcommands, and wiring."""
