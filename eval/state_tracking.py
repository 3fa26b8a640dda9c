#!/usr/bin/env python
"""State-tracking probes (single runs, sweeps, tables, plots): the CLI of ``bilinear_lm.probes.cli`` (``--help``)."""
import sys

from bilinear_lm.probes.cli import main

if __name__ == "__main__":
    sys.exit(main())
