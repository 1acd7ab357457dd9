"""The package's version (one place: ``fastreduce.__version__``; pyproject.toml says the same)."""

__version__ = "0.1.0"
