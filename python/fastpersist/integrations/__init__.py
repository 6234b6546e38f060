"""Adapters that plug fastpersist into training frameworks.

Each adapter lives in its own module, imports its framework lazily (the
core install does not depend on any framework) and uses only fastpersist's
public API and the modules below it. Install a framework's extra to use its
adapter, e.g. ``pip install fastpersist[lightning]``.
"""

__all__: list = []
