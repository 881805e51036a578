"""``lightning-diffusion report OUTPUT [--html FILE] [--device-hour-price P]``: one HTML page of a run.

    lightning-diffusion report outputs/tiny --device-hour-price 2.5

Writes a self-contained page (no server, no network: it opens from a laptop or a shared folder)
with the gallery (thumbnails grouped by prompt, seeds side by side, a search box over the
captions), the failed and rejected records with their reasons, the pace (images per minute per
worker from the manifest's times, stalls and the last worker to finish marked, each resume its own
segment), the cost (device-hours, images per device-hour, money per image at
``--device-hour-price``), an ``eval``'s verdicts beside each image it judged (``--eval FILE``, or
``OUTPUT/eval.json``: ``eval OUTPUT --json OUTPUT/eval.json`` leaves one) and the settings. Reads
every layout the writer makes: loose files (flat or sharded), webdataset and Parquet shards and
buckets (``s3://...``). Writes nothing there but the page (by default) and the thumbnails, which
are made once into ``OUTPUT/.thumbs`` (a bucket's beside the page) and reused. A set larger than
``--page-size`` images pages its gallery (``FILE-STEM.pages/``), with a sample of the whole set on
the first page. Exit code 0; 2 for an output that is not one of lightning-diffusion.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from lightning_diffusion.commands import add_json_option, help_text, json_argv
from lightning_diffusion.commands import report as emit
from lightning_diffusion.core.errors import ConfigError

if TYPE_CHECKING:
    from lightning_diffusion.output.settings import StorageOptions

PAGE_SIZE = 300


def build(output: str, html: Optional[str] = None, price: Optional[float] = None, devices: Optional[int] = None,
          page_size: int = PAGE_SIZE, thumbs: Optional[str] = None,
          options: Optional[StorageOptions] = None, eval_result: Optional[str] = None) -> dict[str, Any]:
    """Write the report of ``output``; returns what was done (pages, thumbnails, counts, cost).
    ``eval_result``: an ``eval``'s result (``--json FILE.json``) whose verdicts the page shows
    (default: the folder's ``eval.json`` where there is one). Raises ``ConfigError`` for an output
    that is not one of lightning-diffusion, or an eval result that is not one."""
    from lightning_diffusion.report import collect, pace, page, plots
    from lightning_diffusion.report.thumbs import FOLDER, make_thumbs
    from lightning_diffusion.report.verdicts import EVAL_FILE, read_verdicts

    started = time.perf_counter()
    with collect.opened(output, options) as found:
        first = Path(html) if html else (Path("report.html") if found.is_bucket else Path(output) / "report.html")
        first = first.resolve()
        if thumbs:
            root = Path(thumbs)
        elif found.is_bucket:
            root = first.with_name(first.stem + ".thumbs")
        else:
            root = found.folder / FOLDER
        read_s = time.perf_counter() - started
        judged = Path(eval_result) if eval_result else (found.folder / EVAL_FILE if not found.is_bucket else None)
        verdicts = read_verdicts(judged, found.records) if judged is not None and (
            eval_result or judged.is_file()) else None
        made, broken = make_thumbs(found.records, found.folder, root)
        thumbs_s = time.perf_counter() - started - read_s
        spans = pace.spans(found.histories, devices)
        workers = pace.workers(found.records, spans)
        cost = pace.cost(spans, price)
        png = plots.pace_png(workers, spans)
        note = "" if plots.available() else f"The pace plot needs matplotlib: {plots.INSTALL}"
        devices_note = ("Devices: as given (--devices)." if devices else
                        "Devices: the run's recorded world size, else its writing ranks (a context- or "
                        "tensor-parallel group writes from one rank: give --devices for such runs).")
        layout = page.Layout(first=first, thumbs=root, folder=found.folder, link_files=not found.is_bucket)
        written = page.write_pages(found, layout, broken, workers, cost, plots.data_uri(png) if png else None, note,
                                   devices_note, page_size, verdicts)
        return {
            "output": found.where, "html": str(first), "pages": len(written),
            "bytes": sum(path.stat().st_size for path in written), "first_page_bytes": written[0].stat().st_size,
            "images": len(found.records), "expected": found.expected, "running": found.running,
            "failed": len(found.failed), "rejected": len(found.rejected), "not_counted": len(found.not_counted),
            "unreadable": len(broken), "thumbs_made": made, "thumbs": str(root),
            "device_h": cost.total["device_h"], "images_per_device_h": cost.total["images_per_device_h"],
            "money": cost.total["money"], "money_per_image": cost.total["money_per_image"],
            "plot": png is not None, "plot_note": note,
            "judged": len(verdicts.by_index) if verdicts is not None else None,
            "seconds": round(time.perf_counter() - started, 3), "read_s": round(read_s, 3),
            "thumbs_s": round(thumbs_s, 3),
        }


def text(result: dict[str, Any]) -> str:
    pages = f" ({result['pages']} pages)" if result["pages"] > 1 else ""
    lines = [f"{result['html']}{pages}: {result['images']:,} outputs"
             + (f" of {result['expected']:,}" if result["expected"] else "")
             + (", a run is writing now" if result["running"] else "")
             + f"; {result['thumbs_made']:,} thumbnails made into {result['thumbs']} in {result['seconds']:.1f} s"]
    extras = [f"{result[key]:,} {name}" for key, name in (("failed", "failed"), ("rejected", "rejected records"),
                                                          ("not_counted", "lines not counted"),
                                                          ("unreadable", "unreadable outputs")) if result[key]]
    if extras:
        lines.append("  " + ", ".join(extras))
    if result["images_per_device_h"] is not None:
        money = (f", {result['money']:,.4f} in all, {result['money_per_image']:.6f} an image"
                 if result["money"] is not None and result["money_per_image"] is not None else "")
        lines.append(f"  cost: {result['device_h']:,.4f} device-hours, {result['images_per_device_h']:,.1f} images per "
                     f"device-hour{money}")
    if result["plot_note"]:
        lines.append("  " + result["plot_note"])
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-diffusion report", description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", help="an output folder or bucket URL (writer.output_dir)")
    parser.add_argument("--html", metavar="FILE", help="the page to write (default: OUTPUT/report.html; for a bucket, "
                                                        "report.html here)")
    parser.add_argument("--device-hour-price", type=float, metavar="P",
                        help="the price of a device-hour: adds the cost per run, in total and per image")
    parser.add_argument("--devices", type=int, metavar="N",
                        help="the devices every run held (default: the recorded world size, else the writing ranks)")
    parser.add_argument("--page-size", type=int, default=PAGE_SIZE, metavar="N",
                        help=f"images a gallery page holds at most (default {PAGE_SIZE})")
    parser.add_argument("--thumbs", metavar="DIR", help="where the thumbnails are kept (default: OUTPUT/.thumbs; for "
                                                         "a bucket, beside the page)")
    parser.add_argument("--eval", metavar="FILE.json", dest="eval_result",
                        help="an eval's result (eval OUTPUT --json FILE.json) whose verdicts the page shows beside "
                             "each image (default: OUTPUT/eval.json where there is one)")
    add_json_option(parser, "what was written")
    args = parser.parse_args(json_argv(argv))
    if args.page_size < 1 or (args.devices is not None and args.devices < 1) or (
            args.device_hour_price is not None and args.device_hour_price < 0):
        print("lightning-diffusion report: error: --page-size and --devices must be 1 or more, --device-hour-price "
              "0 or more.", file=sys.stderr)
        return 2
    try:
        result = build(args.output_dir, args.html, args.device_hour_price, args.devices, args.page_size, args.thumbs,
                       eval_result=args.eval_result)
    except ConfigError as err:
        print(f"lightning-diffusion report: error: {err}", file=sys.stderr)
        return 2
    emit(args.json, result, lambda: print(text(result)))
    return 0
