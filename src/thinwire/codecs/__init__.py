"""Codecs: one file each; see base.py for the protocol and registry.py for specs."""
