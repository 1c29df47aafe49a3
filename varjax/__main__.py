"""``python -m varjax``: the command line of ``varjax.tools.cli``."""
import sys

from varjax.tools.cli import main

sys.exit(main())
