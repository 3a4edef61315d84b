"""The package version: a leaf, so that what records it (a checkpoint's metadata) need not import the package."""

__version__ = "0.1.0"
