"""The router's request path: one typed :class:`RequestContext` carried through named stages (pipeline.py)."""
