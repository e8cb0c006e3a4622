"""``python -m smcdecode.distill ...``: the same command as ``smcdecode distill ...``."""

import sys

from .cli import main

sys.exit(main())
