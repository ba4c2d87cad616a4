"""Attention backends behind one interface; see ``base.py``."""

from .base import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]


def get_backend(device: str) -> AttentionBackend:
    """The Triton kernels on CUDA, the PyTorch reference everywhere else."""
    if str(device).startswith("cuda"):
        from .triton_backend import TritonBackend

        return TritonBackend()
    from .torch_backend import TorchBackend

    return TorchBackend()
