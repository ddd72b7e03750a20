"""Multi-turn environments and their tools (``base.py``, ``tools.py``); episodes on the engine
(``episodes.py``). A ``Task`` (``data/tasks``) is the one-turn case."""
