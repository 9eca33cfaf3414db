"""autotune: find the fastest numerically-equivalent configuration of a PyTorch training script."""

__version__ = "0.1.0"
