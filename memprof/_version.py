"""The version of memprof (its own module, so that any module may import it without a cycle)."""

__version__ = "0.1.0"
