"""sdbench: benchmark and tune speculative decoding."""

__version__ = "0.1.0"
