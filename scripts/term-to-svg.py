#!/usr/bin/env python3
"""Renders a captured terminal screen (plain text, e.g. `tmux capture-pane -p`) as an SVG image:
monospace text on a dark background, one <text> line per row, so the picture stays what the
terminal showed, box-drawing and block characters included.

    python3 scripts/term-to-svg.py CAPTURE.txt OUT.svg [--title TITLE]
"""
import argparse
import html

CHAR_W, LINE_H, PAD = 8.4, 17, 12


def render(lines: list, title: str) -> str:
    cols = max((len(l) for l in lines), default=1)
    w = int(cols * CHAR_W + 2 * PAD)
    h = int(len(lines) * LINE_H + 2 * PAD)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">',
           f'<title>{html.escape(title)}</title>',
           f'<rect width="{w}" height="{h}" fill="#1e1e1e"/>',
           '<g font-family="DejaVu Sans Mono, Menlo, Consolas, monospace" font-size="14" fill="#d4d4d4" '
           'xml:space="preserve">']
    for i, line in enumerate(lines):
        y = PAD + (i + 1) * LINE_H - 4
        out.append(f'<text x="{PAD}" y="{y}" textLength="{len(line) * CHAR_W:.1f}" '
                   f'lengthAdjust="spacingAndGlyphs">{html.escape(line)}</text>' if line.strip() else "")
    out.append("</g></svg>")
    return "\n".join(x for x in out if x) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("capture")
    p.add_argument("out")
    p.add_argument("--title", default="cuda-ipc watch")
    a = p.parse_args()
    with open(a.capture, encoding="utf-8", errors="replace") as f:
        lines = [l.rstrip("\n") for l in f]
    while lines and not lines[-1].strip():
        lines.pop()
    with open(a.out, "w", encoding="utf-8") as f:
        f.write(render(lines, a.title))


if __name__ == "__main__":
    main()
