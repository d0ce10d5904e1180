"""Clients of the controller and the training API (what users import to drive their own loops)."""
