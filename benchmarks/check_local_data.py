"""Check a data folder for the local lm-eval tasks (``$BILINEAR_LM_DATA_DIR`` or ``--data-dir``) against the
published counts: WikiText-2 raw in EleutherAI's document-level split (60 validation and 62 test pages, the first
test page "Robert Boulter", nothing of the file lost) and LAMBADA OpenAI (5,153 passages). Prints a table; exits 1
on a mismatch. (The tests run the loaders on tests/data instead: they never read a real data folder.)

    python benchmarks/check_local_data.py --data-dir ../shared/data
"""
import argparse
import os
import sys
from pathlib import Path

from bilinear_lm.evaluation.lm_eval_tasks import bilinear_local_utils as local


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", help=f"default: ${local.DATA_ENV}")
    args = parser.parse_args(argv)
    if args.data_dir:
        os.environ[local.DATA_ENV] = args.data_dir
    wiki, lam = local.load_wikitext2(), local.load_lambada_openai()
    raw = (Path(os.environ[local.DATA_ENV]) / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    pages = wiki["test"]["page"]
    checks = [
        ("wikitext-2 validation pages", len(wiki["validation"]), 60),
        ("wikitext-2 test pages", len(wiki["test"]), 62),
        ("first test page", pages[0].splitlines()[0].strip(), "= Robert Boulter ="),
        ("first validation page", wiki["validation"][0]["page"].splitlines()[0].strip(), "= Homarus gammarus ="),
        ("test pages joined = the file from its first page", "".join(pages) == raw[raw.index(" = Robert Boulter"):],
         True),
        ("every test page starts at a level-1 heading",
         all(p.startswith(" = ") and not p.startswith(" = = ") for p in pages), True),
        ("lambada_openai passages", len(lam["test"]), 5153),
    ]
    print("| check | found | published |\n|---|---|---|")
    for name, found, expected in checks:
        print(f"| {name} | {found} | {expected}{'' if found == expected else ' (MISMATCH)'} |")
    return int(any(found != expected for _, found, expected in checks))


if __name__ == "__main__":
    sys.exit(main())
