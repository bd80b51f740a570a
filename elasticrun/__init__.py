"""elasticrun: an elastic launcher for distributed PyTorch training, used like torchrun."""

__version__ = "0.1.0"
