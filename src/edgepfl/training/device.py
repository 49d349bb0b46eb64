"""Where tensors live: the training device a run asks for, and copies to and from it."""

from __future__ import annotations

import torch

from edgepfl.errors import ConfigError


def host(t: torch.Tensor) -> torch.Tensor:
    """A private, contiguous CPU copy of ``t`` (from any device, in any memory layout)."""
    if t.device.type == "cpu":
        return t.clone(memory_format=torch.contiguous_format)
    return t.to("cpu", memory_format=torch.contiguous_format)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, queued without waiting for the GPU.

    A CUDA copy from pageable host memory first waits until every kernel already queued
    has run (CUDA's "API synchronization behavior"): one such copy per batch would leave a
    launch-bound GPU idle while the host gathers the next batch. Staged in pinned memory,
    the copy is queued like a kernel; PyTorch's caching host allocator keeps the pinned
    block until the copy is done. Anywhere else it is ``t.to(device)``.
    """
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=True)


def select_device(setting: str) -> torch.device:
    """``train.device``: ``auto`` is CUDA when PyTorch sees a GPU, else the CPU."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"train.device = 'cuda', but PyTorch {torch.__version__} sees no CUDA GPU (a CPU "
            f"build, or no driver); valid here: 'cpu' or 'auto' (the GPU when there is one)")
    if setting not in ("cpu", "cuda"):
        raise ConfigError(f"train.device = {setting!r}; valid: 'auto', 'cpu', 'cuda'")
    device = torch.device(setting)
    if device.type == "cuda":
        # cuDNN's default TF32 convolutions round inputs to 10 mantissa bits: after two
        # rounds of SGD a MOON run's accuracy moved 3 points from the CPU's; in float32
        # every algorithm lands within 1e-5 of it (bench/checks/README.md, "Every algorithm on a GPU")
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    return device


def server_device(setting: str) -> torch.device:
    """Where a server forms what it computes in bulk (KAPC's Gram matrices): the GPU when
    ``train.device`` allows it and this process has one (a Flower ServerApp may not)."""
    return torch.device("cuda" if setting != "cpu" and torch.cuda.is_available() else "cpu")
