"""``lightning-diffusion download --config X.yaml [--dry-run] [any predict flag ...]``: fetch, where
there is network, exactly the files ``predict`` will read from the Hugging Face Hub for this config
(diffusers' own choice: the pipeline's components in safetensors, the variant and revision asked
for, nothing unused), into the standard cache (``HF_HOME``), resuming a broken download. Compute
nodes then run the same config with ``HF_HUB_OFFLINE=1``. A ``data.prompts`` of
``hf://datasets/NAME`` is fetched too: the Parquet files of its ``data.split`` (default ``train``),
which the runs then read from the same cache. ``--dry-run`` lists the files and their sizes without
fetching.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, Optional

from lightning_diffusion.commands import help_text
from lightning_diffusion.core.errors import ConfigError
from lightning_diffusion.pipelines import hub
from lightning_diffusion.run.config import read_config, report_config_error

if TYPE_CHECKING:
    from jsonargparse import Namespace


def model_of(config: Namespace) -> tuple[str, dict[str, Any]]:
    model = config.model
    return model.pretrained_model_name_or_path, hub.hub_options(dict(model.get("from_pretrained_kwargs") or {}))


def fetch_for(config: Namespace, config_path: Optional[str], dry_run: bool = False, out=sys.stdout) -> Optional[str]:
    """Plan (and unless ``dry_run`` fetch) the config's hub weights; the snapshot folder, or None
    for a local model. Hub failures raise a ConfigError with their own message."""
    repo, options = model_of(config)
    if not hub.is_hub_id(repo):
        print(f"{repo} is not a hub id (a local folder or a tiny pipeline): nothing to fetch.", file=out)
        return None
    if hub.offline():  # nothing can be fetched: enough if the cache holds it all
        missing = hub.missing_from_cache(repo, options)
        if missing is None or missing:
            what = "is not in the cache" if missing is None else f"lacks {', '.join(missing[:5])} in the cache"
            raise ConfigError(f"{repo} {what} ({hub.cache_folder(options)}) and HF_HUB_OFFLINE=1 is set, so nothing "
                              "can be fetched from here: unset it on a machine with network, or set HF_HOME to a "
                              "cache that holds the weights.")
        folder = hub.snapshot_of(repo, options)
        print(f"{repo}: every file from_pretrained reads is in the cache at {folder} (HF_HUB_OFFLINE=1: nothing "
              "fetched)", file=out)
        return str(folder)
    try:
        planned = hub.plan(repo, options)
        if dry_run:
            for f in planned.files:
                print(f"{hub.describe(f.size):>10}  {'cached ' if f.cached else 'to fetch'}  {f.filename}", file=out)
            print(f"{repo} at {planned.commit[:12]}: {len(planned.files)} files, {hub.describe(planned.total_bytes)}; "
                  f"{len(planned.to_fetch)} to fetch, {hub.describe(planned.bytes_to_fetch)}, into "
                  f"{hub.cache_folder(options)}", file=out)
            return None
        hub.check_space(planned, options)
        folder = hub.fetch(repo, options)
    except ConfigError:
        raise
    except Exception as err:  # the hub's and diffusers' own errors, said in one line each
        known = hub.message(err, repo, options, config_path)
        if known is None:
            raise
        raise ConfigError(known) from err
    print(f"{repo}: {len(planned.files)} files, {hub.describe(planned.total_bytes)} in the cache "
          f"({hub.describe(planned.bytes_to_fetch)} fetched now) at {folder}", file=out)
    return str(folder)


def fetch_prompts(config: Namespace, config_path: Optional[str], dry_run: bool = False,
                  out=sys.stdout) -> Optional[str]:
    """Plan (and unless ``dry_run`` fetch) a ``data.prompts`` of ``hf://datasets/NAME``: the Parquet
    files of ``data.split`` (``formats.split_names``); the snapshot folder, or None for prompts
    from elsewhere."""
    from lightning_diffusion.input import formats

    prompts, split = config.data.get("prompts"), config.data.get("split") or "train"
    if not (isinstance(prompts, str) and prompts.startswith("hf://")):
        return None
    name, revision = formats.hub_dataset(prompts)
    if hub.offline():  # nothing can be fetched: enough if the cache holds the split
        try:
            found = formats.read_records(prompts, split=split, columns=config.data.get("columns"))
        except ConfigError as err:
            raise ConfigError(f"{err} (HF_HUB_OFFLINE=1 is set: nothing can be fetched from here.)") from None
        print(f"{prompts} (split {split}): {len(found):,} records in the cache (HF_HUB_OFFLINE=1: nothing fetched)",
              file=out)
        return None
    from huggingface_hub import HfApi, snapshot_download

    try:
        info = HfApi().dataset_info(name, revision=revision, files_metadata=True)
        sizes = {s.rfilename: s.size for s in info.siblings or []}
        chosen = formats.split_names([f for f in sizes if f.endswith(".parquet")], split)
        if not chosen:
            raise ConfigError(f"{prompts} has no Parquet file of split {split!r} on the hub (its files: "
                              f"{', '.join(sorted(sizes)[:12]) or 'none'}); lightning-diffusion reads a dataset's "
                              "Parquet files.")
        total = sum(sizes[f] or 0 for f in chosen)
        if dry_run:
            for f in chosen:
                print(f"{hub.describe(sizes[f]):>10}  {f}", file=out)
            print(f"{prompts} (split {split}): {len(chosen)} Parquet files, {hub.describe(total)}", file=out)
            return None
        folder = snapshot_download(name, repo_type="dataset", revision=revision, allow_patterns=chosen)
    except ConfigError:
        raise
    except Exception as err:  # the hub's own errors, said in one line
        known = hub.message(err, prompts, None, config_path)
        raise ConfigError(known or f"{prompts}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                          ) from err
    print(f"{prompts} (split {split}): {len(chosen)} Parquet files, {hub.describe(total)} in the cache at {folder}",
          file=out)
    return str(folder)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-diffusion download", description=help_text(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--dry-run", action="store_true", help="list the files and their sizes; fetch nothing")
    args, extra = parser.parse_known_args(argv)
    try:
        config = read_config(args.config, extra, check=False)
        fetch_for(config, args.config, args.dry_run)
        fetch_prompts(config, args.config, args.dry_run)
    except ValueError as err:
        return report_config_error(err, "lightning-diffusion download")
    return 0
