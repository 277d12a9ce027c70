"""Algorithms decide what is reduced, when, and with whom; each attaches to the user's loop."""
