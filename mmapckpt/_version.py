"""The package's version, in a module of its own so that the command line reads it without importing the face."""

__all__ = ["__version__"]

__version__ = "0.1.0"
