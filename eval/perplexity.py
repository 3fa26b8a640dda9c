#!/usr/bin/env python
"""Perplexity of a checkpoint over a text: the CLI of ``bilinear_lm.evaluation.perplexity`` (``--help``)."""
import sys

from bilinear_lm.evaluation.perplexity import main

if __name__ == "__main__":
    sys.exit(main())
