"""Text sources for conversion and evaluation."""
