"""Byte sizes for the CLI's options (``--budget 16GiB``): see :mod:`leanact._format`."""
from leanact._format import MAX_SIZE, format_bytes, parse_size

__all__ = ["parse_size", "format_bytes", "MAX_SIZE"]
