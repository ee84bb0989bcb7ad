"""A report's blocks (compare/report/render.py) written out as markdown and as one self-contained HTML
page (images inlined), from the same list, so the two never disagree. A block is a tuple whose first item
names its kind: h1, h2, p, verdict (its headline, the judged pairs as a table, sentences), ul, table, figs, pre.
"""
from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path


def to_markdown(blocks: list[tuple]) -> str:
    out = []
    for block in blocks:
        kind = block[0]
        if kind == "h1":
            out.append(f"# {block[1]}")
        elif kind == "h2":
            out.append(f"## {block[1]}")
        elif kind == "p":
            out.append(block[1])
        elif kind == "verdict":  # headline, its tables (pairs, speed), failures' sentences, lines, warnings
            _, _, headline, tables, failures, lines, warnings = block
            out.append(f"## Verdict: {headline}")
            bullets = lambda items: "\n".join("- **{}:**{}".format(*line.split(":", 1)) for line in items)  # noqa: E731
            if tables:
                out.append(markdown_table(*tables[0]))
            if failures:
                out.append(bullets(failures))
            out += [markdown_table(*table) for table in tables[1:]]
            if lines or warnings:
                out.append("\n".join(filter(None, [bullets(lines)] + [f"- **Warning:** {w}" for w in warnings])))
        elif kind == "ul":
            out.append("\n".join(f"- {item}" for item in block[1]))
        elif kind == "table":
            out.append(markdown_table(block[1], block[2]))
        elif kind == "figs":
            out += [f"### {title}\n\n![{title}]({path})" for title, path, _ in block[1]]
        elif kind == "pre":
            out.append(f"```sh\n{block[1]}\n```")
    return "\n\n".join(out) + "\n"


def markdown_table(headers: tuple, rows: list[tuple], lead: Sequence[str] = ()) -> str:
    """A table, after the `lead` lines that must be read before it (the speed pairs that measure the machine)."""
    cell = lambda x: str(x).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = [" | ".join(cell(c) for c in headers), " | ".join("---" for _ in headers)]
    lines += [" | ".join(cell(c) for c in row) for row in rows]
    table = "\n".join(f"| {line} |" for line in lines)
    return "".join("- **{}:**{}\n".format(*line.split(":", 1)) for line in lead) + ("\n" if lead else "") + table


CSS = """
body { font: 15px/1.5 -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; color: #1d1d1f;
       max-width: 1200px; margin: 2em auto; padding: 0 1.2em; background: #fff; }
h1 { font-size: 1.6em; margin-bottom: .2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 1.8em; }
h3 { margin: 1.2em 0 .4em; font-size: 1.05em; color: #444; }
.meta { color: #666; margin-top: 0; }
.verdict { border-radius: 8px; padding: .8em 1.2em; margin: 1em 0; border: 1px solid; }
.verdict.pass { background: #eef8f0; border-color: #5cb270; } .verdict.fail { background: #fdeeee; border-color: #d9534f; }
.verdict.other { background: #f4f4f6; border-color: #aaa; }
.verdict h2 { border: none; margin: 0 0 .3em; } .verdict ul { margin: .2em 0; padding-left: 1.2em; }
.warn { color: #8a5a00; } li.failure { color: #8b1c24; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; font-size: 13px; margin: .6em 0; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f6; } tr:nth-child(even) td { background: #fafafa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.badge { display: inline-block; padding: 0 .5em; border-radius: 4px; font-weight: 600; font-size: 12px; }
.b-pass { background: #d4edda; color: #1e6b2f; } .b-fail { background: #f8d7da; color: #8b1c24; }
.b-other { background: #e9e9ec; color: #444; }
.figs { display: grid; grid-template-columns: repeat(auto-fit, minmax(460px, 1fr)); gap: 1em 1.5em; }
figure { margin: 0; } figure.wide { grid-column: 1 / -1; text-align: center; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
td:first-child { white-space: nowrap; font-weight: 600; }
pre { background: #f6f8fa; padding: .8em 1em; border-radius: 6px; overflow-x: auto; font-size: 12.5px; }
"""

# Records, once the page has loaded, whether every embedded figure decoded (headless tests read it).
IMAGE_CHECK = """
window.addEventListener("load", function () {
  var images = Array.prototype.slice.call(document.images);
  var ok = images.filter(function (img) { return img.complete && img.naturalWidth > 0; }).length;
  document.body.setAttribute("data-images-loaded", ok + "/" + images.length);
});
"""


def badge(text: str) -> str:
    cls = {"pass": "b-pass", "ok": "b-pass", "fail": "b-fail", "failed": "b-fail"}.get(text.lower(), "b-other")
    return f'<span class="badge {cls}">{html.escape(text)}</span>'


def to_html(blocks: list[tuple], out_dir: Path) -> str:
    body = []
    for block in blocks:
        kind = block[0]
        if kind == "h1":
            body.append(f"<h1>{html.escape(block[1])}</h1>")
        elif kind == "h2":
            body.append(f"<h2>{html.escape(block[1])}</h2>")
        elif kind == "p":
            body.append(f'<p class="{"meta" if block[1].startswith("Report created") else ""}">'
                        f"{html.escape(block[1])}</p>")
        elif kind == "verdict":
            _, verdict, headline, tables, failures, lines, warnings = block
            cls = verdict if verdict in ("pass", "fail") else "other"
            item = lambda line, css="": "<li{}><b>{}:</b>{}</li>".format(  # noqa: E731
                css, *map(html.escape, line.split(":", 1)))
            failed = "".join(item(line, ' class="failure"') for line in failures)
            items = "".join(item(line) for line in lines)
            items += "".join(f'<li class="warn"><b>Warning:</b> {html.escape(w)}</li>' for w in warnings)
            headline = html.escape(headline).replace(verdict.upper(), badge(verdict.upper()), 1)
            body.append(f'<div class="verdict {cls}"><h2>Verdict: {headline}</h2>'
                        + (html_table(*tables[0]) if tables else "") + (f"<ul>{failed}</ul>" if failed else "")
                        + "".join(html_table(*table) for table in tables[1:])
                        + (f"<ul>{items}</ul>" if items else "") + "</div>")
        elif kind == "ul":
            body.append("<ul>" + "".join(f"<li>{html.escape(item)}</li>" for item in block[1]) + "</ul>")
        elif kind == "table":
            body.append(html_table(block[1], block[2]))
        elif kind == "figs":
            figures = []
            for title, path, wide in block[1]:
                data = base64.b64encode((out_dir / path).read_bytes()).decode()
                figures.append(f'<figure class="{"wide" if wide else ""}"><h3>{html.escape(title)}</h3>'
                               f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}"></figure>')
            body.append('<div class="figs">' + "".join(figures) + "</div>")
        elif kind == "pre":
            body.append(f"<pre>{html.escape(block[1])}</pre>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>dpcompare report</title><style>{CSS}</style></head>\n<body>\n"
            + "\n".join(body) + f"\n<script>{IMAGE_CHECK}</script>\n</body></html>\n")


def html_table(headers: tuple, rows: list[tuple], lead: Sequence[str] = ()) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(html_cell(c) for c in row) + "</tr>" for row in rows)
    first = "".join('<p class="warn"><b>{}:</b>{}</p>'.format(*map(html.escape, line.split(":", 1))) for line in lead)
    return first + f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


VERDICT_WORDS = ("ok", "failed", "pass", "fail", "differs", "skipped", "not comparable", "no data", "incomplete")


def html_cell(value) -> str:
    text = str(value)
    if text in VERDICT_WORDS:
        return f"<td>{badge(text)}</td>"
    # Numbers (with separators, units, ranges) align right; prose stays left.
    numeric = bool(text) and all(ch.isdigit() or ch in ",.–-%[]()/<ex+ " for ch in text) and any(ch.isdigit() for ch in text)
    return f'<td class="num">{html.escape(text)}</td>' if numeric else f"<td>{html.escape(text)}</td>"
