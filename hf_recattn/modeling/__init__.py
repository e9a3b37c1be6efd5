"""The runtime that ships beside every checkpoint (flat: siblings import each other as `from .x import y`)."""
