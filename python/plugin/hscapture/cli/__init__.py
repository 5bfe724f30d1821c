"""The ``hscapture`` command: ``extract``, ``demo``."""
