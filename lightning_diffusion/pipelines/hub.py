"""Weights on the Hugging Face Hub: exactly what a config's ``from_pretrained`` reads, fetched ahead
of a job (``lightning-diffusion download``), checked in the cache where nodes have no network, and
a message of its own for each way a hub id can fail.

What ``from_pretrained`` reads is diffusers' own plan: ``DiffusionPipeline.download`` works out the
files (the pipeline's components in safetensors, the variant, no unused component) and hands them
to ``huggingface_hub.snapshot_download`` as allow and ignore patterns. ``plan`` runs that same code
and asks ``snapshot_download`` for a dry run instead (file names, sizes, what is cached), so the
list cannot drift from what a run opens (diffusers 0.42.1, huggingface_hub 2.4).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, NoReturn, Optional

from lightning_diffusion.core.errors import ConfigError

if TYPE_CHECKING:
    from huggingface_hub import DryRunFileInfo

# from_pretrained options that choose which files of a repository are read; the first three are
# also those of a single file's download (hf_hub_download has no variant).
FILE_OPTIONS = ("revision", "token", "cache_dir")
HUB_OPTIONS = (*FILE_OPTIONS, "variant", "use_safetensors")


def file_options(options: Optional[dict[str, Any]]) -> dict[str, Any]:
    return {k: v for k, v in (options or {}).items() if k in FILE_OPTIONS and v is not None}


def is_hub_id(path: object) -> bool:
    """``owner/name`` that is not a local folder (nor a ``tiny:`` pipeline)."""
    return (isinstance(path, str) and not path.startswith(("tiny:", ".", "/", "~")) and path.count("/") == 1
            and not Path(path).expanduser().exists())


def hub_options(from_pretrained_kwargs: Optional[dict[str, Any]]) -> dict[str, Any]:
    return {k: v for k, v in (from_pretrained_kwargs or {}).items() if k in HUB_OPTIONS and v is not None}


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


UNREACHABLE = "LIGHTNING_DIFFUSION_HUB_UNREACHABLE"


@functools.lru_cache(maxsize=1)
def reachable(timeout_s: float = 3.0) -> bool:
    """Whether the hub's endpoint answers a TCP connection within ``timeout_s`` (a name that does
    not resolve fails at once), or, where a proxy applies to it (``HTTPS_PROXY``, ``NO_PROXY``), the
    proxy does: a network that reaches the hub only through a proxy is online. One probe a process."""
    import socket
    import urllib.request
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and url.hostname and not urllib.request.proxy_bypass(url.hostname):
        url = urlparse(proxy if "://" in proxy else f"http://{proxy}")  # the hub is reached through it
    if not url.hostname:
        return True  # an endpoint or proxy this cannot read (no scheme): leave the answer to huggingface_hub
    address = (url.hostname, url.port or (443 if url.scheme == "https" else 80))
    try:
        socket.create_connection(address, timeout=timeout_s).close()
    except OSError:
        return False
    return True


def offline_unless_reachable() -> bool:
    """Work from the cache alone when the hub cannot be reached: huggingface_hub would otherwise
    retry each request with back-off (12 lines and about 30 s before the first error, seen in an
    offline container). Sets ``HF_HUB_OFFLINE`` for this process (huggingface_hub reads it at each
    request) and for the ranks it starts; returns whether it is offline."""
    if offline():
        return True
    if reachable():
        return False
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ[UNREACHABLE] = "1"  # why it is offline, for this process's messages and its ranks'
    constants.HF_HUB_OFFLINE = True
    return True


NOT_CACHED = "is not in the Hugging Face cache"


def offline_reason() -> str:
    return ("HF_HUB_OFFLINE=1 is set" if offline() and not os.environ.get(UNREACHABLE)
            else "the hub cannot be reached from here")


def cache_folder(options: Optional[dict[str, Any]] = None) -> Path:
    from huggingface_hub import constants

    return Path((options or {}).get("cache_dir") or constants.HF_HUB_CACHE).expanduser()


def download_command(config: Optional[str]) -> str:
    return f"lightning-diffusion download --config {config or 'YOUR-CONFIG.yaml'} (with the flags you give predict)"


def message(err: BaseException, repo: str, options: Optional[dict[str, Any]] = None,
            config: Optional[str] = None) -> Optional[str]:
    """What to tell a user whose hub id failed with ``err`` (the error or its cause), or None when
    it is not a hub error."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    revision = (options or {}).get("revision") or "main"
    chain: list[BaseException] = []
    current: Optional[BaseException] = err
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    for e in chain:
        if isinstance(e, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
            return (f"{repo} {NOT_CACHED} ({cache_folder(options)}) and {offline_reason()}. Fetch it where there "
                    f"is network: {download_command(config)} (for a cluster, into a cache every node sees); or set "
                    "HF_HOME to the folder that holds it.")
        if isinstance(e, GatedRepoError):
            return (f"{repo} is a gated repository: accept its licence on https://huggingface.co/{repo} with your "
                    "account, then set HF_TOKEN to a token of that account (or run `hf auth login`).")
        if isinstance(e, RevisionNotFoundError):
            return f"{repo} has no revision {revision!r}: check model.from_pretrained_kwargs.revision."
        if isinstance(e, RepositoryNotFoundError):
            return (f"{repo} is not a repository on the hub (or a private one: set HF_TOKEN to a token that can "
                    "read it).")
        if isinstance(e, EntryNotFoundError):
            return (f"{repo!r} is not a diffusers pipeline: it has no model_index.json. Pass a hub id of a diffusers "
                    "pipeline or a folder written by DiffusionPipeline.save_pretrained.")
    for e in chain:
        if isinstance(e, ValueError) and "variant=" in str(e) and "no such modeling files" in str(e):
            variant = (options or {}).get("variant")
            return (f"{repo} has no weights of variant {variant!r}: drop model.from_pretrained_kwargs.variant, or "
                    "choose a variant its files have.")
        if _network_error(e):
            return (f"the hub cannot be reached for {repo} ({type(e).__name__}: {e}); run this where there is network, "
                    f"or fetch the weights there first: {download_command(config)} (for a cluster, into a cache every "
                    "node sees).")
    return None


def _network_error(err: BaseException) -> bool:
    """A connection that failed (refused, timed out, no route), as httpx and requests raise it."""
    names = {cls.__name__ for cls in type(err).__mro__}
    return bool(names & {"ConnectError", "ConnectTimeout", "NetworkError", "ConnectionError", "TimeoutException"})


# ----------------------------------------------------------------------------- diffusers' plan


@dataclass(frozen=True)
class HubFile:
    filename: str
    size: Optional[int]
    cached: bool


@dataclass
class Plan:
    repo: str
    commit: str
    files: list[HubFile]

    @property
    def to_fetch(self) -> list[HubFile]:
        return [f for f in self.files if not f.cached]

    @property
    def bytes_to_fetch(self) -> int:
        return sum(f.size or 0 for f in self.to_fetch)

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)


class _Planned(Exception):
    def __init__(self, result: Optional[list[DryRunFileInfo]], patterns: dict[str, Any]) -> None:
        super().__init__("planned")
        self.result, self.patterns = result, patterns


@contextlib.contextmanager
def _snapshot_dry_run() -> Iterator[None]:
    """``DiffusionPipeline.download`` with its final ``snapshot_download`` turned into a dry run
    that raises ``_Planned`` with the file list and the patterns diffusers chose."""
    from diffusers.pipelines import pipeline_utils

    original = pipeline_utils.snapshot_download

    def planned(repo_id: str, **kwargs: Any) -> NoReturn:
        patterns = {k: kwargs.get(k) for k in ("allow_patterns", "ignore_patterns", "revision")}
        result = None if kwargs.get("local_files_only") else original(repo_id, dry_run=True, **kwargs)
        raise _Planned(result, patterns)

    pipeline_utils.snapshot_download = planned
    try:
        yield
    finally:
        pipeline_utils.snapshot_download = original


def _download_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    return {"use_safetensors": True, **options}  # as the module loads (safetensors unless asked otherwise)


def plan(repo: str, options: Optional[dict[str, Any]] = None) -> Plan:
    """The files ``from_pretrained`` reads for ``repo`` with these options, their sizes and which
    are cached (needs the hub)."""
    from diffusers import DiffusionPipeline
    from huggingface_hub import hf_hub_download, model_info
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    options = hub_options(options)
    # diffusers reads a failed repository lookup as "offline"; ask first, so that each failure says what it is.
    model_info(repo, revision=options.get("revision"), token=options.get("token"))
    hf_hub_download(repo, "model_index.json", **file_options(options))
    shown = not are_progress_bars_disabled()
    disable_progress_bars()
    with _snapshot_dry_run():
        try:
            DiffusionPipeline.download(repo, force_download=True, **_download_kwargs(options))
        except _Planned as done:
            if done.result is None:  # diffusers' own lookup failed between ours and its own
                raise ConfigError(f"the hub stopped answering for {repo} while its files were listed; try again.")
            files = [HubFile(i.filename, i.file_size, bool(i.is_cached)) for i in done.result]
            commit = done.result[0].commit_hash if done.result else ""
            return Plan(repo, commit, sorted(files, key=lambda f: f.filename))
        finally:
            if shown:
                enable_progress_bars()
    raise RuntimeError(f"diffusers planned no download for {repo}")  # download() changed: see the docstring


def missing_from_cache(repo: str, options: Optional[dict[str, Any]] = None) -> Optional[list[str]]:
    """Offline: the files ``from_pretrained`` would read that the cache lacks, from the cached
    listing of the repository and diffusers' patterns; None when nothing of ``repo`` is cached."""
    from diffusers import DiffusionPipeline
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    options = hub_options(options)
    cache = options.get("cache_dir")
    index = try_to_load_from_cache(repo, "model_index.json", cache_dir=cache, revision=options.get("revision"))
    if not isinstance(index, str):
        return None
    with _snapshot_dry_run():
        try:
            DiffusionPipeline.download(repo, local_files_only=True, **_download_kwargs(options))
        except _Planned as done:
            patterns = done.patterns
        except (OSError, CachedRepoTreeNotFoundError):
            return None
        else:
            return []
    try:
        from huggingface_hub import get_cached_repo_tree

        listing = [f.path for f in get_cached_repo_tree(repo, revision=patterns.get("revision"), cache_dir=cache)]
    except (CachedRepoTreeNotFoundError, OSError):
        return None
    allow, ignore = patterns.get("allow_patterns") or ["*"], patterns.get("ignore_patterns") or []
    expected = [f for f in listing if any(fnmatch.fnmatch(f, p) for p in allow)
                and not any(fnmatch.fnmatch(f, p) for p in ignore)]
    snapshot = Path(index).parent
    return sorted(f for f in expected if not (snapshot / f).is_file())


def fetch(repo: str, options: Optional[dict[str, Any]] = None, progress: bool = True) -> Path:
    """Fetch what ``from_pretrained`` reads into the cache (resuming a broken download); returns
    the snapshot folder."""
    from diffusers import DiffusionPipeline
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    if not progress:
        disable_progress_bars()
    try:
        return Path(DiffusionPipeline.download(repo, **_download_kwargs(hub_options(options))))
    finally:
        if not progress:
            enable_progress_bars()


def check_space(planned: Plan, options: Optional[dict[str, Any]] = None) -> None:
    """The cache's file system can take what is to be fetched (from the listed sizes)."""
    folder = cache_folder(options)
    existing = next(p for p in [folder, *folder.parents] if p.exists())
    free = shutil.disk_usage(existing).free
    if planned.bytes_to_fetch > free:
        raise ConfigError(f"{planned.repo} needs {planned.bytes_to_fetch / 1e9:,.2f} GB more in {folder}, but its file "
                          f"system has {free / 1e9:,.2f} GB free: free some, or set HF_HOME to a larger one.")


def describe(size: Optional[int]) -> str:
    if size is None:
        return "? B"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size} B"


def snapshot_of(repo: str, options: Optional[dict[str, Any]] = None) -> Optional[Path]:
    """The cached snapshot folder of ``repo``, if its model_index.json is cached."""
    from huggingface_hub import try_to_load_from_cache

    options = hub_options(options)
    found = try_to_load_from_cache(repo, "model_index.json", cache_dir=options.get("cache_dir"),
                                   revision=options.get("revision"))
    return Path(found).parent if isinstance(found, str) else None
