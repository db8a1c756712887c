"""Worked examples of extension points (importable by the server's Python)."""
