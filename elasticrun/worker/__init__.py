"""What training scripts import; the only subpackage that may import torch."""
