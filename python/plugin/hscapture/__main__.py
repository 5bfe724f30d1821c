"""``python -m hscapture ...`` is the ``hscapture`` command."""

from .cli.main import main

raise SystemExit(main())
