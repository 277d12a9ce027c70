"""Short texts between ranks (a host name, an address, a fingerprint) as fixed-width rows of bytes,
so that one all_gather or broadcast of a known size carries them: the width is the longest
text the caller allows, a text shorter than it is padded with zero bytes, a longer one refused."""

from __future__ import annotations

import torch

from thinwire.comm.base import Communicator


def to_row(data: bytes, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``data`` as a row of ``width`` bytes (uint8), zero-padded; longer data raises ``ValueError``."""
    if len(data) > width:
        raise ValueError(f"{data[:60]!r}... is longer than {width} bytes")
    row = torch.zeros(width, dtype=torch.uint8)
    if data:
        row[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return row.to(device)


def from_row(row: torch.Tensor) -> bytes:
    """The bytes a row holds, its zero padding dropped."""
    return bytes(row.cpu().tolist()).rstrip(b"\0")


def gather_bytes(comm: Communicator, data: bytes, width: int, device: torch.device | str = "cpu") -> list[bytes]:
    """Every rank's ``data``, in rank order, through one all_gather of ``width`` bytes a rank."""
    every = torch.zeros(comm.world_size, width, dtype=torch.uint8, device=device)
    comm.all_gather(to_row(data, width, device), every)
    return [from_row(row) for row in every]


def share_bytes(comm: Communicator, data: bytes, width: int, device: torch.device | str = "cpu") -> bytes:
    """Rank 0's ``data`` on every rank, through one broadcast of ``width`` bytes."""
    row = to_row(data, width, device)
    comm.broadcast(row, src=0)
    return from_row(row)
