"""``python -m fastreduce``: the same as the ``fastreduce`` command."""

from .cli import main

raise SystemExit(main())
