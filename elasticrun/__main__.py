"""`python -m elasticrun`: the torchrun-compatible launcher."""

from elasticrun.launcher.cli import console_main

if __name__ == "__main__":
    console_main()
