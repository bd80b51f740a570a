"""A --warm-imports module for tests/test_warm_start.py: torch says CUDA is initialised.

The one fake of the warm tests: there is no GPU here, so a standby that initialised
CUDA is played by one whose `torch.cuda.is_initialized()` answers True.
"""

import torch

torch.cuda.is_initialized = lambda: True
