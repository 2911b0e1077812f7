"""The command line (``cli``), ``inspect`` (``describe``) and ``verify``: the top wing.

``cli`` dispatches to every wing, ``bench`` included (imported only when chosen).
"""
