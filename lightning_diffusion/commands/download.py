"""``lightning-diffusion download --config X.yaml [--dry-run] [any predict flag ...]``: fetch, where
there is network, exactly the files ``predict`` will read from the Hugging Face Hub for this config
(diffusers' own choice: the pipeline's components in safetensors, the variant and revision asked
for, nothing unused), into the standard cache (``HF_HOME``), resuming a broken download. Compute
nodes then run the same config with ``HF_HUB_OFFLINE=1``. ``--dry-run`` lists the files and their
sizes without fetching.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from lightning_diffusion import hub
from lightning_diffusion.config import read_config, report_config_error
from lightning_diffusion.errors import ConfigError


def model_of(config: Any) -> tuple[str, dict[str, Any]]:
    model = config.model
    return model.pretrained_model_name_or_path, hub.hub_options(dict(model.get("from_pretrained_kwargs") or {}))


def fetch_for(config: Any, config_path: Optional[str], dry_run: bool = False, out=sys.stdout) -> Optional[str]:
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


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-diffusion download", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--dry-run", action="store_true", help="list the files and their sizes; fetch nothing")
    args, extra = parser.parse_known_args(argv)
    try:
        config = read_config(args.config, extra, check=False)
        fetch_for(config, args.config, args.dry_run)
    except ValueError as err:
        return report_config_error(err, "lightning-diffusion download")
    return 0
