"""Communicators: torch.distributed, in-process, byte meter, link model."""
