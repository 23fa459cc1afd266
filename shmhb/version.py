"""The package's version: a leaf module, so that the CLI reads it without importing the
package's ``__init__``."""

__version__ = "0.1.0"
