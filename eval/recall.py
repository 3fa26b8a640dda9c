#!/usr/bin/env python
"""MQAR associative-recall sweep: the CLI of ``bilinear_lm.probes.recall_cli`` (``--help``)."""
import sys

from bilinear_lm.probes.recall_cli import main

if __name__ == "__main__":
    sys.exit(main())
