"""Placeholder: filled in by issue 16 work."""
