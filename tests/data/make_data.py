"""Write tests/data: a tiny stand-in for the offline data folder the local lm-eval tasks read
(``$BILINEAR_LM_DATA_DIR``), in the same layout and file formats as the real datasets, made only from public-domain
text: Tiny Shakespeare as the package ships it (``bilinear_lm.training.DEFAULT_TRAIN_FILE``). Deterministic;
test_lm_eval.py checks that the committed files are this script's output.

    python tests/data/make_data.py            # from the repository root: rewrites the files below

- ``wikitext-2-raw/wiki.{valid,test}.raw``: WikiText-2's raw format. The file starts with a `` \\n`` line; every
  article starts at a top-level `` = Title = `` line; sections are `` = = Heading = = `` and subsections
  `` = = = Heading = = = ``, each followed by a `` \\n`` line; every paragraph is one line, `` `` + tokens + `` \\n``,
  tokenized as WikiText is (punctuation split off by spaces, `` @-@ `` for a hyphen inside a word, `` 's``); a
  `` \\n`` line closes each section. Here an article is a run of consecutive speeches (``Speaker : words ...``, one
  paragraph each) titled by its first speaker; headings name the lines of tinyshakespeare.txt they hold, with an
  en dash (a non-ASCII character, as WikiText has: bytes differ from characters).
- ``lambada/lambada_test.jsonl``: LAMBADA's OpenAI jsonl, one ``{"text": ...}`` per line, paragraphs separated by
  a blank line, the target being the last word (after the last space), which also occurs earlier in the passage.
  Here a passage is a run of consecutive speeches, cut after a word that occurred before.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (first speech, at least this many characters per article); the speeches are the blank-line-separated blocks
WIKI_ARTICLES = {"wiki.valid.raw": [(400, 350), (460, 350)],
                 "wiki.test.raw": [(0, 450), (60, 600), (120, 750), (180, 350)]}
LAMBADA_STARTS = [600, 640, 680, 720, 760, 800, 840, 880]  # first speech of each passage
LAMBADA_WORDS = (30, 150)  # the target is the first repeated word in this range of word positions


def speeches(text: str) -> list[tuple[int, str, list[str]]]:
    """(1-based line number of the speaker's line, speaker, lines spoken) for every block of the text."""
    out, line_no = [], 1
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if len(lines) >= 2 and lines[0].endswith(":"):
            out.append((line_no + (block.startswith("\n")), lines[0][:-1], lines[1:]))
        line_no += block.count("\n") + 2
    return out


def wikitext_tokenize(words: str) -> str:
    """WikiText-2's tokenization of plain text: hyphens inside words as @-@, punctuation and 's split off."""
    words = re.sub(r"(?<=\w)-(?=\w)", " @-@ ", words)
    words = re.sub(r"([,.;:!?])", r" \1 ", words)
    words = re.sub(r"(?<=\w)'s\b", " 's", words)
    return " ".join(words.split())


def paragraph(speaker: str, lines: list[str]) -> str:
    return f" {wikitext_tokenize(speaker)} : {wikitext_tokenize(' '.join(lines))} \n"


def heading(level: int, first: int, last: int) -> str:
    marks = " ".join("=" * level)
    return f" {marks} Lines {first} \u2013 {last} {marks} \n \n"


def wikitext_file(blocks, articles) -> str:
    out = [" \n"]
    for start, min_chars in articles:
        first_line, speaker, lines = blocks[start]
        page = [f" = {speaker} = \n", " \n", paragraph(speaker, lines), " \n"]
        i, section, level = start + 1, 0, 2
        while sum(map(len, page)) < min_chars:
            pair = blocks[i:i + 2]
            page.append(heading(level, pair[0][0], pair[-1][0] + len(pair[-1][2])))
            page += [paragraph(s, l) for _, s, l in pair] + [" \n"]
            i, section = i + 2, section + 1
            level = 3 if level == 2 else 2  # a section, then a subsection of it, and so on
        out += page + [" \n"]
    return "".join(out)


def lambada_passage(blocks, start: int) -> str:
    text = "\n\n".join(" ".join(lines) for _, _, lines in blocks[start:start + 12])
    words = [(m.start(), m.group(1)) for m in re.finditer(r"([A-Za-z']+)[^\sA-Za-z']*", text)]  # word, punctuation
    lo, hi = LAMBADA_WORDS
    for k in range(lo, min(hi, len(words))):
        at, word = words[k]
        if word.isalpha() and len(word) >= 4 and text[at - 1] == " " and word in {w for _, w in words[:k]}:
            return text[:at + len(word)]
    raise ValueError(f"no repeated word between word {lo} and {hi} of the passage at speech {start}")


def build(text: str) -> dict[str, str]:
    """Relative path -> file content."""
    blocks = speeches(text)
    files = {f"wikitext-2-raw/{name}": wikitext_file(blocks, arts) for name, arts in WIKI_ARTICLES.items()}
    files["lambada/lambada_test.jsonl"] = "".join(json.dumps({"text": lambada_passage(blocks, s)}) + "\n"
                                                  for s in LAMBADA_STARTS)
    return files


def source_text() -> str:
    from bilinear_lm.training import DEFAULT_TRAIN_FILE

    return Path(DEFAULT_TRAIN_FILE).read_text(encoding="utf-8")


if __name__ == "__main__":
    for rel, content in build(source_text()).items():
        path = HERE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode("utf-8"))
        print(f"{path.relative_to(HERE.parents[1])}: {len(content.encode('utf-8'))} bytes")
