#!/usr/bin/env python3
"""Plain-text training documents from Debian's python3-doc (stdlib only).

`kvllm train` needs a few hundred thousand tokens of long, natural text that
every Debian machine can have without a download: the reStructuredText
sources of the Python documentation (package python3-doc, installed by
scripts/setup.sh) under /usr/share/doc/python3-doc/html/_sources. This
converts a chosen subset of them to plain text, one file per group:

    <out>/python-doc-<group>.txt

Groups: the prose parts (tutorial, howto, faq, reference, and the 3.x
"What's New" documents). Left out on purpose: license.rst.txt and
copyright.rst.txt (licence texts: the e2e benchmarks evaluate on Debian's
licences, and training on the evaluation's kind of text would flatter it),
whatsnew/changelog (a list of issue titles, not prose) and every
index.rst.txt (tables of contents). Files are read in sorted order, so the
output is deterministic.

Markup removed: explicit markup (directives `.. name:: args` with their
option lines; the content of prose directives such as note and
versionadded is kept, that of index / toctree / comments / targets is
dropped), roles (:func:`x` -> x, :ref:`title <target>` -> title, :pep:`8`
-> PEP 8), inline literals (``x`` -> x), links, emphasis, section
underlines and table borders, the `::` that opens a literal block;
literal blocks (code) are kept verbatim; runs of blank lines become one.

Usage: python3 benchmarks/scripts/python_doc_text.py [--out data/train]
       [--groups tutorial,howto] [--src DIR] [--max-group-bytes N]
"""

import argparse
import fnmatch
import os
import re
import sys

SOURCES = "/usr/share/doc/python3-doc/html/_sources"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# group -> (directory, file patterns)
GROUPS = {
    "tutorial": ("tutorial", ["*.rst.txt"]),
    "howto": ("howto", ["*.rst.txt"]),
    "faq": ("faq", ["*.rst.txt"]),
    "reference": ("reference", ["*.rst.txt"]),
    "whatsnew": ("whatsnew", ["3.[6-9].rst.txt", "3.1[0-9].rst.txt"]),  # the recent releases
}
# never converted, whatever the group's patterns say
EXCLUDED = ["license.rst.txt", "copyright.rst.txt", "*licen[cs]e*", "changelog.rst.txt", "index.rst.txt"]

# directives whose whole block (content included) is dropped
DROP_BLOCK = {
    "index", "toctree", "only", "raw", "image", "figure", "include", "literalinclude",
    "highlight", "tabularcolumns", "sectionauthor", "moduleauthor", "codeauthor",
    "testsetup", "testcleanup", "productionlist", "impl-detail-hidden", "contents",
    "audit-event", "audit-event-table", "availability", "opcode",
}
# directives whose content is code: kept verbatim
LITERAL = {"code-block", "code", "sourcecode", "doctest", "testcode", "testoutput", "parsed-literal"}
VERSION_NOTES = {"versionadded": "New in version", "versionchanged": "Changed in version",
                 "deprecated": "Deprecated since version"}

EXPLICIT = re.compile(r"^(\s*)\.\.(?:\s+(.*))?$")
DIRECTIVE = re.compile(r"^(?:\|[^|]+\|\s+)?([\w:.-]+)::\s*(.*)$")
OPTION = re.compile(r"^\s+:[\w -]+:(\s.*)?$")
UNDERLINE = re.compile(r"^\s*([=\-~^\"#*+`'.:_!])\1{2,}\s*$")
TABLE_BORDER = re.compile(r"^\s*[=+\-]{3,}(?:[ +]+[=+\-]{3,})*\s*$")
ROLE = re.compile(r":([\w:.+-]+):`([^`]*)`")


def indent_of(line):
    return len(line) - len(line.lstrip(" "))


def role_text(m):
    role, text = m.group(1), m.group(2)
    title = re.match(r"^(.*?)\s*<[^>]*>$", text, re.S)
    if title and title.group(1):
        text = title.group(1)
    text = text.lstrip("!")
    if text.startswith("~"):
        text = text[1:].split(".")[-1]
    if role in ("pep", "rfc"):
        return f"{role.upper()} {text}"
    if role in ("issue", "gh"):
        return f"{'bpo' if role == 'issue' else 'gh'}-{text}"
    return text


def inline(line):
    """Inline markup of prose (a paragraph: markup may span its lines), to plain text."""
    line = ROLE.sub(role_text, line)
    line = re.sub(r"``(.+?)``", r"\1", line, flags=re.S)
    line = re.sub(r"`([^`<]*?)\s*<[^>`]*>`__?", r"\1", line)  # `text <url>`_
    line = re.sub(r"`([^`]+)`__?", r"\1", line)               # `name`_
    line = re.sub(r"`([^`]+)`", r"\1", line)                  # interpreted text
    line = re.sub(r"\s*\[(?:#\w*|\d+|\*)\]_", "", line)       # footnote references
    line = re.sub(r"\*\*(\S(?:.*?\S)?)\*\*", r"\1", line, flags=re.S)
    line = re.sub(r"(?<![\w*])\*(\S(?:[^*]*?\S)?)\*(?![\w*])", r"\1", line)
    line = re.sub(r"\|(\w[\w -]*)\|", r"\1", line)            # substitutions
    line = line.replace("\\ ", "")                            # escaped space (``x``\ s)
    line = line.rstrip()
    if line.endswith("::"):  # opens a literal block: "text::" -> "text:", "text ::" and "::" -> "text"
        body = line[:-2]
        line = body.rstrip() if not body.strip() or body.endswith(" ") else body + ":"
    return line


def convert(text):
    """One reStructuredText document to plain text."""
    out = []
    para = []               # prose lines of the current paragraph
    drop_indent = None      # dropping a block: lines indented more than this
    literal_after = None    # a literal block may open: lines indented more than this
    literal_min = None      # inside a literal block: lines indented at least this
    options_open = False    # just after a kept directive: skip its :option: lines

    def flush():
        if para:
            out.extend(inline("\n".join(para)).split("\n"))
            para.clear()

    for raw in text.splitlines():
        line = raw.rstrip()
        blank = not line.strip()
        ind = indent_of(line)
        if blank or drop_indent is not None or literal_after is not None or literal_min is not None \
                or EXPLICIT.match(line):
            flush()
        if drop_indent is not None:
            if blank or ind > drop_indent:
                continue
            drop_indent = None
        if literal_after is not None:
            if blank:
                out.append("")
                continue
            if ind > literal_after:  # the block's indent is its first line's
                literal_min = ind
            literal_after = None
        if literal_min is not None:
            if blank or ind >= literal_min:
                out.append(line)
                continue
            literal_min = None
        if options_open:
            if OPTION.match(line):
                continue
            options_open = False
        m = EXPLICIT.match(line)
        if m:
            body = (m.group(2) or "").strip()
            d = DIRECTIVE.match(body)
            name = d.group(1) if d else None
            if name is None or name in DROP_BLOCK or body.startswith("|"):
                # comments, targets (.. _x:), footnotes, substitutions, dropped directives
                drop_indent = ind
                continue
            options_open = True
            if name in LITERAL:
                literal_after = ind
            elif name in VERSION_NOTES:
                out.append(" " * ind + inline(f"{VERSION_NOTES[name]} {d.group(2)}.".replace(" .", ".")))
            elif name in ("note", "warning", "seealso", "tip", "important", "attention", "caution",
                          "hint", "impl-detail", "admonition", "rubric", "topic", "sidebar"):
                if d.group(2):
                    out.append(" " * ind + inline(d.group(2)))
            # other directives (function, class, module, ...): their
            # arguments are signatures, dropped with the line
            continue
        if blank:
            out.append("")
            continue
        if UNDERLINE.match(line) or TABLE_BORDER.match(line):
            flush()
            continue
        para.append(line)
        if line.endswith("::"):
            flush()
            literal_after = ind
    flush()
    # runs of blank lines become one, none at the ends
    text = "\n".join(out)
    text = re.sub(r"\n[ \t]*(\n[ \t]*)+\n", "\n\n", text)
    return text.strip("\n") + "\n"


def group_files(src, group):
    directory, patterns = GROUPS[group]
    root = os.path.join(src, directory)
    names = sorted(os.listdir(root))
    files = []
    for n in names:
        if any(fnmatch.fnmatch(n, p) for p in patterns) and not any(fnmatch.fnmatch(n, x) for x in EXCLUDED):
            files.append(os.path.join(root, n))
    return files


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=SOURCES, help="python3-doc's _sources directory")
    ap.add_argument("--out", default=os.path.join(REPO, "data", "train"), help="output directory")
    ap.add_argument("--groups", default=",".join(GROUPS), help="comma-separated, of: " + ", ".join(GROUPS))
    ap.add_argument("--max-group-bytes", type=int, default=0,
                    help="stop adding files to a group past this size (0: no limit)")
    args = ap.parse_args()
    if not os.path.isdir(args.src):
        sys.exit(f"{args.src} not found: install the Debian package python3-doc (scripts/setup.sh does)")
    groups = [g for g in args.groups.split(",") if g]
    for g in groups:
        if g not in GROUPS:
            sys.exit(f"unknown group {g!r}; groups: {', '.join(GROUPS)}")
    os.makedirs(args.out, exist_ok=True)
    total = 0
    print(f"{'file':<48} {'files':>5} {'bytes':>10} {'~tokens':>9}")
    for g in groups:
        parts = []
        size = 0
        files = group_files(args.src, g)
        used = 0
        for f in files:
            if args.max_group_bytes and size >= args.max_group_bytes:
                break
            with open(f, encoding="utf-8") as fh:
                t = convert(fh.read())
            parts.append(t)
            size += len(t.encode("utf-8")) + 1
            used += 1
        path = os.path.join(args.out, f"python-doc-{g}.txt")
        data = "\n".join(parts).encode("utf-8")
        with open(path, "wb") as fh:
            fh.write(data)
        total += len(data)
        # SmolLM2's BPE reads about 4 bytes of English prose per token
        print(f"{os.path.relpath(path):<48} {used:>5} {len(data):>10} {len(data) // 4:>9}")
    print(f"{'total':<48} {'':>5} {total:>10} {total // 4:>9}")


if __name__ == "__main__":
    main()
