"""The report's HTML: self-contained pages (thumbnails and the plot embedded as data, the style and
the little script inline; no server, no network). Every text from the run (captions, reasons,
settings) goes through ``html.escape``; the data the script reads is JSON whose ``<`` is escaped, so
a caption holding ``<script>`` stays text.

Page 1 (``--html FILE``) holds the summary, the problems, the pace, the cost, the settings and the
first page of the gallery; a larger set's further gallery pages are ``FILE-STEM.pages/page-N.html``,
with a sample view of the whole set on page 1 and an index of every prompt for the search box
(``search.js``, loaded by each page where it is there).
"""

from __future__ import annotations

import base64
import datetime
import html
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lightning_diffusion.report.collect import Collected, Record, env_of, when
from lightning_diffusion.report.pace import Cost, Worker
from lightning_diffusion.report.thumbs import thumb_path
from lightning_diffusion.report.verdicts import Verdict, Verdicts

SEARCH_INDEX_GROUPS = 200_000  # prompts the cross-page search index holds at most
SAMPLE = 120  # thumbnails of the sample view
TABLE_ROWS = 500  # failed, rejected and not-counted lines shown (the rest counted)

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0 auto;max-width:1400px;padding:0 16px 40px;color:#222;
background:#fafafa}
h1{font-size:20px;margin:16px 0 4px}h2{font-size:17px;margin:24px 0 8px;border-bottom:1px solid #ddd}
.state{margin:4px 0 12px;color:#444}.running{color:#a60}
.cards{display:flex;flex-wrap:wrap;gap:8px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:6px 12px}
.card b{display:block;font-size:18px}
table{border-collapse:collapse;background:#fff;margin:4px 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;
vertical-align:top}th{background:#f0f0f0}td.n{text-align:right;font-variant-numeric:tabular-nums}
.group{background:#fff;border:1px solid #e2e2e2;border-radius:6px;margin:8px 0;padding:6px 10px}
.group h3{font-size:14px;margin:2px 0 6px;font-weight:600;word-break:break-word}
.seeds{display:flex;flex-wrap:wrap;gap:8px}figure{margin:0;width:164px;font-size:11px;color:#555;overflow-wrap:anywhere}
figure img,figure video{display:block;width:160px;height:160px;object-fit:contain;border:1px solid #ccc;background:#eee}
.details{font-size:11px;color:#666;margin:-4px 0 6px;overflow-wrap:anywhere}
.verdict.ok{color:#1a7f37}.verdict.bad{color:#b42318}
figure.broken .missing{width:160px;height:90px;display:flex;align-items:center;justify-content:center;
background:#fee;color:#a00;border:1px dashed #a00}
.sample{display:flex;flex-wrap:wrap;gap:2px}.sample img{width:64px;height:64px;object-fit:cover}
#search{font-size:15px;padding:4px 8px;width:420px;max-width:90%}nav a{margin-right:6px}
.stall{color:#c22}.last{font-weight:600}pre{background:#fff;border:1px solid #ddd;padding:8px;overflow:auto}
.badge{background:#334;color:#fff;border-radius:3px;padding:0 4px;font-size:10px}
"""

SCRIPT = """
(function () {
  var config = JSON.parse(document.getElementById('report-config').textContent);
  var box = document.getElementById('search');
  var groups = Array.prototype.slice.call(document.querySelectorAll('.group'));
  var shown = document.getElementById('shown');
  var elsewhere = document.getElementById('elsewhere');
  function href(page) {
    if (page === config.page) { return '#'; }
    return page === 1 ? config.first : config.pages + 'page-' + String(page).padStart(5, '0') + '.html';
  }
  function apply() {
    var query = box.value.trim().toLowerCase();
    var count = 0;
    groups.forEach(function (group) {
      var hit = !query || group.dataset.caption.toLowerCase().indexOf(query) >= 0;
      group.hidden = !hit;
      if (hit) { count += 1; }
    });
    shown.textContent = count + ' of ' + groups.length + ' prompts on this page';
    elsewhere.replaceChildren();
    var index = window.REPORT_GROUPS;
    if (!query || !index) { return; }
    var hits = index.filter(function (g) { return g[1] !== config.page && g[0].toLowerCase().indexOf(query) >= 0; });
    hits.slice(0, 50).forEach(function (g) {
      var item = document.createElement('li');
      var link = document.createElement('a');
      link.href = href(g[1]);
      link.textContent = g[0];
      item.appendChild(link);
      item.appendChild(document.createTextNode(' (page ' + g[1] + ', ' + g[2] + ' images)'));
      elsewhere.appendChild(item);
    });
    if (hits.length > 50) {
      var more = document.createElement('li');
      more.textContent = (hits.length - 50) + ' more prompts on other pages';
      elsewhere.appendChild(more);
    }
  }
  box.addEventListener('input', apply);
  var asked = /^#q=(.*)$/.exec(location.hash);
  if (asked) { box.value = decodeURIComponent(asked[1]); }
  apply();
}());
"""


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def script_json(value: object) -> str:
    """JSON safe inside ``<script>``: no ``<`` (so no ``</script>`` or ``<!--``)."""
    return json.dumps(value, ensure_ascii=False).replace("<", "\\u003c").replace("\u2028", "\\u2028")\
        .replace("\u2029", "\\u2029")


def number(value: Optional[float], digits: int = 2) -> str:
    if value is None:
        return "–"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(round(seconds))))


@dataclass
class Layout:
    """Where the pages and thumbnails are and how they reach each other."""

    first: Path  # page 1
    thumbs: Path  # the thumbnails' folder
    folder: Path  # the records' local folder (loose videos are linked from it)
    link_files: bool  # loose outputs may be linked from the page (a folder's, not a bucket's download)

    @property
    def pages_dir(self) -> Path:
        return self.first.with_name(self.first.stem + ".pages")

    def page_path(self, page: int) -> Path:
        return self.first if page == 1 else self.pages_dir / f"page-{page:05d}.html"

    def href(self, page: int, here: int) -> str:
        return os.path.relpath(self.page_path(page), self.page_path(here).parent)


def paged(records: list[Record], page_size: int) -> list[list[list[Record]]]:
    """The gallery's pages: groups of one prompt each (in the order of their first image), as many
    whole groups a page as fit in ``page_size`` images (a larger group is split)."""
    groups: dict[str, list[Record]] = {}
    for record in records:
        groups.setdefault(record.prompt, []).append(record)
    pages: list[list[list[Record]]] = [[]]
    size = 0
    for group in groups.values():
        for start in range(0, len(group), page_size):
            part = group[start:start + page_size]
            if size and size + len(part) > page_size:
                pages.append([])
                size = 0
            pages[-1].append(part)
            size += len(part)
    return pages


def _thumb(layout: Layout, record: Record, broken: dict[int, str]) -> str:
    """An ``<img>`` (or ``<video>``) of the record's thumbnail, or the mark of an unreadable one."""
    if record.index in broken:
        why = esc(broken[record.index])
        return f'<div class="missing">unreadable</div><div title="{why}">{why}</div>'
    try:
        data = thumb_path(layout.thumbs, record).read_bytes()
    except OSError:
        return '<div class="missing">no thumbnail</div>'
    uri = "data:image/jpeg;base64," + base64.b64encode(data).decode("ascii")
    alt = esc(f"seed {record.seed}: {record.prompt}")
    if record.is_video and layout.link_files and record.member is None:
        source = esc(os.path.relpath(layout.folder / record.file, layout.first.parent))
        return f'<video controls preload="none" poster="{uri}" src="{source}" title="{alt}"></video>'
    badge = ' <span class="badge">video</span>' if record.is_video else ""
    return f'<img src="{uri}" alt="{alt}" loading="lazy">{badge}'


def _figure(layout: Layout, record: Record, broken: dict[int, str], own_details: bool,
            judged: Optional[Verdict] = None) -> str:
    caption = " · ".join(part for part in (f"seed {record.seed}", record.shape, f"#{record.index}") if part)
    details = (f'<br><span title="{esc(record.details)}">{esc(record.details[:80])}</span>'
               if own_details and record.details else "")
    if judged is not None:
        details += f'<br><span class="verdict {"ok" if judged.ok else "bad"}">eval: {esc(judged.text)}</span>'
    kind = ' class="broken"' if record.index in broken else ""
    return (f'<figure id="i{record.index}"{kind} data-index="{record.index}">{_thumb(layout, record, broken)}'
            f"<figcaption>{esc(caption)}{details}</figcaption></figure>")


def _gallery(layout: Layout, groups: list[list[Record]], broken: dict[int, str],
             judged: Optional[dict[int, Verdict]] = None) -> str:
    judged = judged or {}
    parts = []
    for group in groups:
        prompt = group[0].prompt
        shared = len({record.details for record in group}) == 1  # the call's parameters once, above the seeds
        details = f'<div class="details">{esc(group[0].details)}</div>' if shared and group[0].details else ""
        figures = "".join(_figure(layout, record, broken, not shared, judged.get(record.index)) for record in group)
        parts.append(f'<section class="group" data-caption="{esc(prompt)}"><h3>{esc(prompt)}</h3>{details}'
                     f'<div class="seeds">{figures}</div></section>')
    return "\n".join(parts)


def _nav(layout: Layout, here: int, count: int) -> str:
    if count == 1:
        return ""
    shown = sorted({1, count, *range(max(1, here - 3), min(count, here + 3) + 1)})
    links, previous = [], 0
    for page in shown:
        if page - previous > 1:
            links.append("…")
        links.append(f"<b>{page}</b>" if page == here else f'<a href="{esc(layout.href(page, here))}">{page}</a>')
        previous = page
    return f"<nav>gallery page: {' '.join(links)} (of {count})</nav>"


def _table(head: list[str], rows: list[list[str]], numeric: tuple[int, ...] = ()) -> str:
    cells = "".join(f"<th>{esc(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f'<td class="n">{c}</td>' if i in numeric else f"<td>{c}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def _problems(collected: Collected) -> str:
    parts = []
    if collected.failed:
        rows = [[esc(line.get("index")), esc(line.get("record") or ""), esc(line.get("prompt", "")),
                 esc(line.get("seed", "")), esc(line.get("error", ""))] for line in collected.failed[:TABLE_ROWS]]
        left = len(collected.failed) - TABLE_ROWS
        more = f"<p>{left:,} more in failed.jsonl</p>" if left > 0 else ""
        parts.append(f"<h3>Failed: {len(collected.failed):,} images whose pipeline call failed (a rerun retries them)"
                     f"</h3>{_table(['image', 'record', 'prompt', 'seed', 'error'], rows)}{more}")
    if collected.rejected:
        rows = [[esc(line.get("record", "")), esc(line.get("line", "")), esc(line.get("reason", "")),
                 esc(", ".join(str(i) for i in line.get("images", [])[:8]))]
                for line in collected.rejected[:TABLE_ROWS]]
        parts.append(f"<h3>Rejected: {len(collected.rejected):,} records that cannot be made</h3>"
                     + _table(["record", "where", "reason", "images"], rows))
    if collected.not_counted:
        rows = [[esc(problem)] for problem in collected.not_counted[:TABLE_ROWS]]
        parts.append(f"<h3>Not counted: {len(collected.not_counted):,} manifest lines whose output is missing, "
                     f"truncated or misnamed (a resume makes them again)</h3>" + _table(["line: why"], rows))
    if not parts:
        return "<p>No failed, rejected or uncounted records.</p>"
    return "\n".join(parts)


def _pace(workers: list[Worker], plot: Optional[str], plot_note: str) -> str:
    if not workers:
        return "<p>No manifest line records when it was written: no pace to show.</p>"
    image = f'<p><img alt="images per minute per worker" src="{plot}"></p>' if plot else f"<p>{esc(plot_note)}</p>"
    rows = []
    for worker in workers:
        notes = []
        if worker.last_to_finish:
            notes.append(f'<span class="last">last to finish, {duration(max(0.0, worker.behind_s))} after the median '
                         "of the others</span>")
        for at, seconds in worker.stalls[:5]:
            notes.append(f'<span class="stall">stalled {duration(seconds)} at {esc(when(at))}</span>')
        if len(worker.stalls) > 5:
            notes.append(f'<span class="stall">{len(worker.stalls) - 5} more stalls</span>')
        rows.append([esc(worker.name), f"{worker.count:,}", esc(when(worker.first)), esc(when(worker.last)),
                     number(worker.per_minute, 1), "; ".join(notes)])
    return image + _table(["worker", "images", "first", "last", "images / minute", "notes"], rows, (1, 4))


def _cost(cost: Cost, devices_note: str) -> str:
    priced = cost.price is not None
    head = ["run", "devices", "wall", "device-hours", "images", "images / device-hour"]
    if priced:
        head += ["cost", "cost / image"]
    rows = []
    for row in [*cost.rows, cost.total]:
        cells = [esc(row["label"]), "" if row["devices"] is None else str(row["devices"]), duration(row["wall_s"]),
                 number(row["device_h"], 4), f"{row['made']:,}", number(row["images_per_device_h"], 1)]
        if priced:
            cells += [number(row["money"], 4), number(row["money_per_image"], 6)]
        rows.append(cells)
    price = f" at {cost.price:g} a device-hour" if priced else " (--device-hour-price P adds money per image)"
    return f"<p>Device-hours are each run's wall time (loading included) times its devices{esc(price)}. " \
           f"{esc(devices_note)}</p>" + _table(head, rows, (1, 3, 4, 5, 6, 7))


def _settings(collected: Collected) -> str:
    settings = json.dumps(collected.settings, indent=2, ensure_ascii=False, default=str)
    rows = []
    for source, history in collected.histories.items():
        for number_, run in enumerate(history, start=1):
            env = env_of(run)
            rows.append([esc(f"{source} #{number_}"), esc(when(run.get("finished"))),
                         esc(", ".join(f"{k}: {v}" for k, v in env.items()))])
    table = _table(["run", "finished", "recorded environment"], rows) if rows else "<p>No run recorded yet.</p>"
    return (f"<details><summary>Settings (run.json)</summary><pre>{esc(settings)}</pre></details>"
            f"<details><summary>Environment of each run</summary>{table}</details>")


def state_line(collected: Collected, done: int) -> tuple[str, str]:
    expected = collected.expected
    of = f"{done:,} of {expected:,}" if expected else f"{done:,}"
    left = len({i for line in collected.rejected for i in line.get("images", [])})
    complete = expected is not None and done + left >= expected
    if collected.running:
        return "running", f"A run is writing into it now: this page shows the {of} outputs done so far."
    if complete:
        return "", f"Complete: {of} outputs."
    return "running", f"Incomplete, nobody is running it: {of} outputs done."


def _head(title: str) -> str:
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
            f'content="width=device-width"><title>{esc(title)}</title><style>{CSS}</style></head><body>')


def _cards(collected: Collected, cost: Cost, workers: list[Worker]) -> str:
    cards = [("outputs", f"{len(collected.records):,}" + (f" of {collected.expected:,}" if collected.expected else "")),
             ("prompts", f"{len({record.prompt for record in collected.records}):,}"),
             ("failed", f"{len(collected.failed):,}"), ("rejected records", f"{len(collected.rejected):,}"),
             ("device-hours", number(cost.total["device_h"], 3)),
             ("images / device-hour", number(cost.total["images_per_device_h"], 1))]
    if cost.price is not None:
        cards.append(("cost / image", number(cost.total["money_per_image"], 6)))
    cards.append(("workers", f"{len(workers):,}"))
    return '<div class="cards">' + "".join(f'<div class="card">{esc(label)}<b>{esc(value)}</b></div>'
                                           for label, value in cards) + "</div>"


def _sample(layout: Layout, pages: list[list[list[Record]]]) -> str:
    located = [(record, page) for page, groups in enumerate(pages, start=1) for group in groups for record in group]
    step = max(1, len(located) // SAMPLE)
    items = []
    for record, page in located[::step][:SAMPLE]:
        try:
            data = thumb_path(layout.thumbs, record).read_bytes()
        except OSError:
            continue
        uri = "data:image/jpeg;base64," + base64.b64encode(data).decode("ascii")
        items.append(f'<a href="{esc(layout.href(page, 1))}#i{record.index}" title="{esc(record.prompt)}">'
                     f'<img src="{uri}" alt="{esc(record.prompt)}" loading="lazy"></a>')
    return (f"<h2>Sample of the whole set</h2><p>{len(items)} images evenly through all {len(located):,}; each "
            f"opens its page.</p><div class=\"sample\">{''.join(items)}</div>")


def write_pages(collected: Collected, layout: Layout, broken: dict[int, str], workers: list[Worker], cost: Cost,
                plot: Optional[str], plot_note: str, devices_note: str, page_size: int,
                verdicts: Optional[Verdicts] = None) -> list[Path]:
    """Every page of the report; returns their paths (page 1 first). ``verdicts``: an ``eval``'s,
    beside each image it judged and summed up on page 1."""
    pages = paged(collected.records, page_size)
    count = len(pages)
    title = f"lightning-diffusion report: {collected.where.rstrip('/').rsplit('/', 1)[-1]}"
    kind, state = state_line(collected, len(collected.records))
    state = f"{collected.where}: {state}"
    search_js = layout.pages_dir / "search.js"
    if count > 1:
        layout.pages_dir.mkdir(parents=True, exist_ok=True)
        index = [[group[0].prompt[:200], page, len(group)] for page, groups in enumerate(pages, start=1)
                 for group in groups][:SEARCH_INDEX_GROUPS]
        search_js.write_text("window.REPORT_GROUPS = " + script_json(index) + ";\n", encoding="utf-8")
    written = []
    for page, groups in enumerate(pages, start=1):
        path = layout.page_path(page)
        to_pages = os.path.relpath(layout.pages_dir, path.parent)
        config = {"page": page, "first": layout.href(1, page), "pages": "" if to_pages == "." else to_pages + "/"}
        body = [_head(title), f"<h1>{esc(title)}</h1>", f'<p class="state {kind}">{esc(state)}</p>']
        if page == 1:
            body.append(_cards(collected, cost, workers))
        images = sum(len(group) for group in groups)
        body.append(f'<h2 id="gallery">Gallery</h2>{_nav(layout, page, count)}<p><input id="search" type="search" '
                    f'placeholder="search the captions" aria-label="search the captions"> <span id="shown"></span>'
                    f'</p><ul id="elsewhere"></ul><p>{images:,} images on this page.</p>')
        body.append(_gallery(layout, groups, broken, verdicts.by_index if verdicts is not None else None))
        body.append(_nav(layout, page, count))
        if page == 1:
            if count > 1:
                body.append(_sample(layout, pages))
            body += ["<h2>Failed and rejected</h2>", _problems(collected), "<h2>Pace</h2>",
                     _pace(workers, plot, plot_note), "<h2>Cost</h2>", _cost(cost, devices_note)]
            if verdicts is not None:
                body += ['<h2 id="eval">Eval</h2>',
                         f'<p class="eval-summary">{esc(verdicts.summary)} ({esc(verdicts.source)}; '
                         f'{len(verdicts.by_index):,} of the outputs here judged).</p>']
            body += ["<h2>Settings</h2>", _settings(collected)]
        body.append(f'<script id="report-config" type="application/json">{script_json(config)}</script>')
        if count > 1:
            body.append(f'<script src="{esc(os.path.relpath(search_js, path.parent))}"></script>')
        body.append(f"<script>{SCRIPT}</script></body></html>\n")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text("\n".join(body), encoding="utf-8")
        os.replace(tmp, path)
        written.append(path)
    return written
