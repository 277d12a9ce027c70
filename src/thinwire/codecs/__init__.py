"""Codecs: one file each; see base.py for the protocol and specs.py for names, specs and registration."""
