"""Warnings that every rank would log alike are logged once, by global rank 0."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist


def warn_once(logger: logging.Logger, message: str, *args: Any) -> None:
    """``logger.warning(message, *args)`` on global rank 0 (or without a process group);
    the other ranks log it at debug level."""
    first = not dist.is_initialized() or dist.get_rank() == 0
    logger.log(logging.WARNING if first else logging.DEBUG, message, *args)
