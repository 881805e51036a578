"""``lightning-diffusion slurm``: a config as a SLURM batch job that survives time limits and preemption.

    lightning-diffusion slurm --config X.yaml --nodes 4 --gpus-per-node 8 --time 04:00:00 [--submit [--wait]]
                              [-- --data.prompts p.jsonl ...]   (flags passed on to ``predict``)

The rendered script asks for what Lightning needs (one task per device: ``--ntasks-per-node`` =
``trainer.devices``, ``--nodes`` = ``trainer.num_nodes``, ``srun`` to start the tasks), checks that
every node sees the same output folder, and asks SLURM for ``SIGUSR1`` some minutes before the end.
On that signal the run finishes the images in flight, merges the manifest, and its global rank 0
requeues the job, which resumes from the manifest (see ``preemption``).

With ``writer.output_dir`` in an object store (``s3://bucket/prefix``) the nodes share no folder:
the script skips the shared-folder check, and the script, SLURM's logs and the job array's record go
into ``--job-dir`` (default ``./lightning-diffusion-jobs/<job name>-<tag>``, a tag of the URL), read
back on this machine only; what the job has made is read from the bucket.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Optional, TypedDict

from lightning_diffusion.commands.slurm_jobs import (
    ArrayPlan,
    Outputs,
    _slurm_command,
    plan_array,
    pool_array,
    record_array,
    submit,
    wait_for,
    wait_for_array,
    wait_for_pool,
)
from lightning_diffusion.core.errors import ConfigError, raise_problems
from lightning_diffusion.run.config import check_config, read_config, report_config_error
from lightning_diffusion.run.preflight import build_strategy

DEFAULT_SIGNAL_SECONDS = 300
DEFAULT_CPUS_PER_TASK = 8
SCRIPT_NAME = "lightning-diffusion.sbatch"
JOBS_FOLDER = "lightning-diffusion-jobs"  # under the working folder: the jobs of a run into an object store


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="lightning-diffusion slurm",
        description="Render (and submit) a SLURM batch script that runs `predict` with a config, "
        "requeues itself before a time limit and resumes where it stopped.",
        epilog="Arguments after the known ones (e.g. --data.prompts p.jsonl) are passed on to `predict`.",
    )
    parser.add_argument("--config", required=True, help="the predict config (YAML)")
    parser.add_argument("--nodes", type=int, help="nodes (default: trainer.num_nodes, or 1)")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: trainer.devices)")
    parser.add_argument("--time", help="time limit, e.g. 04:00:00")
    parser.add_argument("--partition")
    parser.add_argument("--account")
    parser.add_argument("--cpus-per-task", type=int)
    parser.add_argument("--mem", help="memory per node, e.g. 200G")
    parser.add_argument("--job-name", help="default: lightning-diffusion-<config name>")
    parser.add_argument(
        "--extra-sbatch", action="append", default=[], metavar="OPTION",
        help="one more #SBATCH option, e.g. --extra-sbatch=--qos=high (repeatable)",
    )
    parser.add_argument(
        "--signal-seconds", type=int, default=DEFAULT_SIGNAL_SECONDS,
        help="seconds before the time limit at which SLURM sends SIGUSR1; must cover one batch "
        f"(default {DEFAULT_SIGNAL_SECONDS})",
    )
    parser.add_argument("--array", type=int, metavar="N",
                        help="a job array of N tasks, task t making shard t of the prompt set (images i with "
                        "the set's batches dealt by cost), all writing into one output folder; with "
                        "data.schedule: pull, N jobs of one pool")
    parser.add_argument("--max-concurrent", type=int, metavar="K", help="with --array: at most K tasks at once")
    parser.add_argument("--resubmit", action="store_true",
                        help="submit an array of the shards of the output folder that are incomplete and not running")
    parser.add_argument("--shards", help="with --array or --resubmit: only these shards, e.g. 3,7")
    parser.add_argument("--job-dir", help="the folder for the script (with --submit), SLURM's logs and the job "
                        "array's record (default: writer.output_dir; for writer.output_dir in an object store: "
                        f"./{JOBS_FOLDER}/<job name>-<a tag of the URL>)")
    parser.add_argument("--script", help=f"write the script here (default with --submit: <job dir>/{SCRIPT_NAME})")
    parser.add_argument("--submit", action="store_true", help="submit with sbatch and print the job id")
    parser.add_argument("--no-download", action="store_true",
                        help="with --submit: do not fetch the config's hub weights here first (the nodes then fetch "
                        "them, or find them in their cache)")
    parser.add_argument("--wait", action="store_true", help="with --submit: wait for the job and report how it ended")
    args, extra = parser.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    if args.resubmit:
        args.submit = True
    if args.wait and not args.submit:
        parser.error("--wait needs --submit")
    if args.array is not None and args.array < 1:
        parser.error(f"--array must be at least 1 (tasks, each a shard of the prompt set), got {args.array}")
    if args.max_concurrent is not None and args.max_concurrent < 1:
        parser.error(f"--max-concurrent must be at least 1, got {args.max_concurrent}")
    if (args.max_concurrent is not None or args.shards) and args.array is None and not args.resubmit:
        parser.error("--max-concurrent and --shards need --array N (or --resubmit)")
    if args.shards is not None:
        try:
            args.shards = sorted({int(part) for part in args.shards.split(",") if part.strip()})
        except ValueError:
            parser.error(f"--shards takes shard numbers such as 3,7, got {args.shards!r}")
    return args, extra


# ----------------------------------------------------------------------------- resources


def _count_devices(devices: Any) -> Optional[int]:
    """Processes per node from ``trainer.devices``; None for ``auto``/``-1`` (known only on the node)."""
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, bool):
        return None
    if isinstance(devices, int):
        return devices if devices >= 1 else None
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    return None


class Resources(TypedDict, total=False):
    """What a job asks SLURM for: ``nodes``, ``tasks_per_node``, ``gpus_per_node`` (None on CPU),
    the weights fetched for it (``weights``) and a job array's plan (``array``)."""

    nodes: int
    tasks_per_node: int
    gpus_per_node: Optional[int]
    weights: Optional[dict[str, str]]
    array: ArrayPlan


def resources(trainer: Any, nodes: Optional[int], gpus_per_node: Optional[int],
              devices_per_process: int = 1) -> Resources:
    """Nodes, tasks per node and GPUs per node that agree with the config, or a ConfigError. A
    process of ``DeviceMapStrategy`` spans ``devices_per_process`` GPUs: a node then needs
    ``trainer.devices x devices_per_process`` GPUs for ``trainer.devices`` tasks."""
    problems = []
    configured_nodes = trainer.get("num_nodes")
    if nodes is not None and nodes < 1:
        problems.append(f"--nodes must be >= 1, got {nodes}.")
    # 1 is also the parsed default: only a config that asks for several nodes can disagree.
    if configured_nodes not in (None, 1) and nodes is not None and int(configured_nodes) != nodes:
        problems.append(
            f"the config says trainer.num_nodes: {configured_nodes} but --nodes {nodes} was asked for; "
            "Lightning needs them equal. Change one of them."
        )
    node_count = nodes if nodes is not None else int(configured_nodes or 1)
    accelerator = str(trainer.get("accelerator") or "auto").lower()
    devices = _count_devices(trainer.get("devices", "auto"))
    on_cpu = accelerator == "cpu"
    per = devices_per_process
    if gpus_per_node is not None and gpus_per_node < 1:
        problems.append(f"--gpus-per-node must be >= 1, got {gpus_per_node}.")
    if on_cpu:
        if gpus_per_node is not None:
            problems.append(
                "the config runs on CPU (trainer.accelerator: cpu) but --gpus-per-node asks for GPUs; "
                "drop --gpus-per-node, or set trainer.accelerator: gpu."
            )
        if devices is None:
            problems.append("a CPU job needs trainer.devices as a number: the processes per node.")
    else:
        if devices is not None and gpus_per_node is not None and devices * per != gpus_per_node:
            spans = f" x devices_per_process {per}" if per > 1 else ""
            problems.append(
                f"the config says trainer.devices: {trainer.get('devices')}{spans} ({devices * per} GPUs per node) but "
                f"--gpus-per-node {gpus_per_node} was asked for; Lightning starts one task per process "
                "(--ntasks-per-node = trainer.devices). Change one of them."
            )
        if gpus_per_node is not None and gpus_per_node % per:
            problems.append(f"--gpus-per-node {gpus_per_node} is not a multiple of devices_per_process {per}.")
        if devices is None and gpus_per_node is None:
            problems.append("say how many GPUs each node has: --gpus-per-node G, or trainer.devices: G in the config.")
    if problems:
        raise ConfigError("\n".join(problems))
    if devices is not None:
        tasks = devices
    else:
        assert gpus_per_node is not None  # neither given was refused above
        tasks = gpus_per_node // per
    return {"nodes": node_count, "tasks_per_node": tasks, "gpus_per_node": None if on_cpu else tasks * per}


def check_output_folder(output_dir: Path, create: bool, what: str = "the output folder") -> None:
    """The folder (for the images, or the job's script and logs) can be created and written from here. Without
    ``create`` (``--script``: the script is only written) nothing is made: the nearest folder that
    exists must be one this user can write into."""
    if not create:
        existing = next((p for p in [output_dir, *output_dir.parents] if p.exists()), Path("/"))
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            why = "is not a folder" if not existing.is_dir() else "is not writable by this user"
            raise ConfigError(f"cannot write {what} {output_dir}: {existing} {why}.")
        return
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"cannot write {what} {output_dir}: {err.strerror or err}.") from None


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def script_value_problems(args: argparse.Namespace, config_path: Path, predict_args: list[str],
                          output_dir: Any, job_dir: Path) -> list[str]:
    """Values that reach the rendered script's ``#SBATCH`` lines or comments, where a newline or
    another control character would end the line and run the rest as a command: refused. (Words
    of the ``srun`` command line are quoted for the shell, those of ``#SBATCH`` lines for sbatch
    (``sbatch_word``), but neither reading lets a quoted word span lines.)"""
    values = {"--job-name": args.job_name, "--partition": args.partition, "--account": args.account,
              "--time": args.time, "--mem": args.mem, "--config": str(config_path),
              "writer.output_dir": str(output_dir), "the job folder": str(job_dir),
              "the working folder": str(Path.cwd()),
              **{f"--extra-sbatch {i + 1}": value for i, value in enumerate(args.extra_sbatch)},
              **{f"predict argument {i + 1}": word for i, word in enumerate(predict_args)}}
    problems = [f"{name} holds a control character (a newline, tab or escape), which would end the script's "
                f"line: {value!r}" for name, value in values.items() if value is not None and _CONTROL.search(value)]
    for value in args.extra_sbatch:
        if not value.startswith("-"):
            problems.append(f"--extra-sbatch takes an sbatch option such as --qos=high, got {value!r}.")
    for name, value in (("--job-name", args.job_name), ("--partition", args.partition), ("--account", args.account),
                        ("--time", args.time), ("--mem", args.mem)):
        if value is not None and (not value.strip() or " " in value):
            problems.append(f"{name} must be one word without spaces, got {value!r}.")
    return problems


_SBATCH_PLAIN = re.compile(r"[\w@%+=:,./-]+", re.ASCII)


def sbatch_word(word: str) -> str:
    """``word`` as one argument of an ``#SBATCH`` line. sbatch splits those lines at white space,
    removes quotes, takes a backslash as an escape and an unescaped ``#`` as the start of a comment
    (older Slurm honours only double quotes, and ends the line at a ``#`` even within them): a word
    of other characters than letters, digits and ``@%+=:,./-`` is written in double quotes with
    ``\\``, ``"`` and ``#`` escaped, which both readings give back as the word. (White space
    ends a word even after a backslash: only quotes keep it.)"""
    if _SBATCH_PLAIN.fullmatch(word):
        return word
    return '"' + re.sub(r'([\\"#])', r"\\\1", word) + '"'


def sbatch_option(flag: str, value: Any) -> str:
    """``--flag=value`` for an ``#SBATCH`` line, the value quoted as sbatch reads it."""
    return f"{flag}={sbatch_word(str(value))}"


def time_limit_seconds(text: Optional[str]) -> Optional[int]:
    """``--time`` in seconds, read as sbatch reads it (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``,
    ``D-HH:MM``, ``D-HH:MM:SS``); None for none, ``UNLIMITED`` or a form it does not know."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", (text or "").strip())
    if match is None:
        return None
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        parts = [int(first), int(second or 0), int(third or 0)]
        return int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
    if third is not None:  # HH:MM:SS
        return int(first) * 3600 + int(second) * 60 + int(third)
    return int(first) * 60 + int(second or 0)  # MM[:SS]


# ----------------------------------------------------------------------------- the script


def command_prefix() -> list[str]:
    """How the compute nodes start this installation: its own entry point, by absolute path."""
    entry = Path(sys.executable).parent / "lightning-diffusion"
    return [str(entry)] if entry.is_file() else [sys.executable, "-m", "lightning_diffusion"]


def _url_tag(url: str) -> str:
    import hashlib

    return hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:8]


def secret_problems(predict_args: list[str]) -> list[str]:
    """A ``writer.storage_options`` value given on the command line goes into the script as it is:
    refused unless it names an environment variable (``env:NAME``)."""
    problems = []
    for i, word in enumerate(predict_args):
        name, sep, value = word.partition("=")
        if not name.startswith("--writer.storage_options"):
            continue
        if not sep:
            value = predict_args[i + 1] if i + 1 < len(predict_args) else ""
        if "env:" not in value or any(v and not str(v).startswith("env:") for v in _values(value)):
            problems.append(f"{name} on the command line would be written into the job's script: give its values "
                            "as env:NAME (read from the environment on the nodes), or set them in the config.")
    return problems


def _values(text: str) -> list[Any]:
    import yaml

    try:
        found = yaml.safe_load(text)
    except yaml.YAMLError:
        return [text]
    return list(found.values()) if isinstance(found, dict) else [found]


def job_name(args: argparse.Namespace, config_path: Path) -> str:
    return args.job_name or f"lightning-diffusion-{config_path.stem}"


def render(
    args: argparse.Namespace, config_path: Path, predict_args: list[str], outputs: Outputs, job_dir: Path,
    res: Resources
) -> str:
    q = shlex.quote
    name = job_name(args, config_path)
    sbatch = [
        sbatch_option("--job-name", name),
        f"--nodes={res['nodes']}",
        f"--ntasks-per-node={res['tasks_per_node']}",
    ]
    if res["gpus_per_node"]:
        sbatch.append(f"--gpus-per-node={res['gpus_per_node']}")
    # Tokenizers, image encoding and NCCL's proxy thread need more than the 1 core a task gets
    # by default; a GPU job gets DEFAULT_CPUS_PER_TASK unless --cpus-per-task says otherwise.
    cpus = (args.cpus_per_task if args.cpus_per_task is not None
            else (DEFAULT_CPUS_PER_TASK if res["gpus_per_node"] else None))
    if cpus is not None:
        sbatch.append(f"--cpus-per-task={cpus}")
    for flag in ("mem", "time", "partition", "account"):
        value = getattr(args, flag)
        if value is not None:
            sbatch.append(sbatch_option(f"--{flag.replace('_', '-')}", value))
    array = res.get("array")
    if array is not None:
        tasks = ",".join(str(t) for t in array["shards"])
        if array["shards"] == list(range(array["num_shards"])) and len(array["shards"]) > 1:
            tasks = f"0-{array['num_shards'] - 1}"
        sbatch.append(f"--array={tasks}" + (f"%{array['max_concurrent']}" if array.get("max_concurrent") else ""))
    log_folder = str(job_dir).replace("%", "%%")  # sbatch replaces %j, %A... in the log's name; %% is a %
    sbatch += [
        f"--signal=USR1@{args.signal_seconds}",
        "--requeue",
        "--open-mode=append",
        sbatch_option("--chdir", Path.cwd()),
        sbatch_option("--output", f"{log_folder}/slurm-{'%A_%a' if array is not None else '%j'}.out"),
        *(sbatch_word(option) for option in args.extra_sbatch),
    ]
    predict = [
        *command_prefix(), "predict", "--config", str(config_path), *predict_args,
        "--trainer.num_nodes", str(res["nodes"]), "--trainer.devices", str(res["tasks_per_node"]),
    ]
    return fill_template("slurm_job.sh", {
        "CONFIG": str(config_path),
        "DATE": str(datetime.date.today()),
        "SBATCH": "\n".join(f"#SBATCH {option}" for option in sbatch),
        "SHARED_FOLDER": (fill_template("slurm_shared_folder.sh", {"OUT": q(str(outputs.folder))}).rstrip("\n") + "\n"
                          if outputs.folder is not None else
                          f"# The images go to {outputs.url}: the nodes need no shared folder.\n"),
        "ARRAY_NOTE": ("" if array is None else
                       " (array task $SLURM_ARRAY_TASK_ID: a job of the pool)" if array.get("pool") else
                       f" (array task $SLURM_ARRAY_TASK_ID: shard $SLURM_ARRAY_TASK_ID of {array['num_shards']})"),
        "WEIGHTS": weights_lines(weights) if (weights := res.get("weights")) else "",
        "CPUS": ("# srun of Slurm 22.05-23.02 does not take --cpus-per-task from the allocation without this.\n"
                 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"') if cpus is not None else "",
        # Every task sees all the node's GPUs and Lightning gives each its own (by local rank); where a
        # site binds one GPU per task by default, Lightning would find 1 of trainer.devices.
        "GPU_BIND": "--gpu-bind=none " if res["gpus_per_node"] else "",
        "PREDICT": " ".join(q(word) for word in predict),
        # Task t of the array makes shard t (SLURM sets SLURM_ARRAY_TASK_ID in each task's environment).
        "SHARD_FLAGS": (f' --data.num_shards {array["num_shards"]} --data.shard_index "$SLURM_ARRAY_TASK_ID"'
                        if array is not None and not array.get("pool") else ""),
    })


def fill_template(name: str, values: dict[str, str]) -> str:
    """The bash template ``name`` (beside this module) with each ``@KEY@`` replaced by its value; a
    line that holds only a placeholder whose value is empty is left out."""
    text = (Path(__file__).parent / name).read_text()
    lines = []
    for line in text.split("\n"):
        key = line.strip()
        if key.startswith("@") and key.endswith("@") and key[1:-1] in values and not values[key[1:-1]]:
            continue
        lines.append(re.sub(r"@([A-Z_]+)@", lambda found: values.get(found[1], found[0]), line))
    return "\n".join(lines)


def weights_lines(weights: dict[str, str]) -> str:
    """The job reads the hub weights fetched on the login node from their cache, offline, after
    checking that every node sees that cache."""
    q = shlex.quote
    return fill_template("slurm_weights.sh", {"CACHE": q(weights["cache"]), "REPO": weights["repo"],
                                              "SNAPSHOT": q(weights["snapshot"])}).rstrip("\n") + "\n"


# ----------------------------------------------------------------------------- sbatch and scontrol


def expected_images(config: Any) -> int:
    from lightning_diffusion.input.formats import read_data

    return len(read_data(config.data)) * int(config.data.num_images_per_prompt)


def fetch_weights(config: Any, config_path: str) -> Optional[dict[str, str]]:
    """A hub id: fetch its weights here (the login node has network; compute nodes often do not),
    or refuse to submit with the reason; None for a local model."""
    from lightning_diffusion.commands.download import fetch_for, model_of
    from lightning_diffusion.pipelines import hub

    repo, options = model_of(config)
    if not hub.is_hub_id(repo):
        return None
    try:
        snapshot = fetch_for(config, config_path)
    except ValueError as err:
        raise ConfigError(f"not submitted: the weights could not be fetched here: {err} (--no-download submits "
                          "without fetching)") from err
    assert snapshot is not None
    return {"repo": repo, "snapshot": snapshot, "cache": str(hub.cache_folder(options))}


# ----------------------------------------------------------------------------- what the job made


# ----------------------------------------------------------------------------- job arrays


# ----------------------------------------------------------------------------- entry point


def main(argv: list[str]) -> int:
    args, predict_args = parse_args(argv)
    try:
        config_path = Path(args.config).expanduser().resolve()
        if not config_path.is_file():
            raise ConfigError(f"no config file at {args.config!r}.")
        # One parse; the checks run once the job's node and device counts are known.
        config = read_config(str(config_path), predict_args, check=False)
        strategy = build_strategy(config.trainer.get("strategy"))
        res = resources(config.trainer, args.nodes, args.gpus_per_node, getattr(strategy, "devices_per_process", 1))
        if args.signal_seconds < 1:
            raise ConfigError(f"--signal-seconds must be >= 1, got {args.signal_seconds}.")
        limit = time_limit_seconds(args.time)
        if limit is not None and args.signal_seconds >= limit:
            print(f"lightning-diffusion slurm: warning: --time {args.time} ({limit} s) is not longer than "
                  f"--signal-seconds {args.signal_seconds}: SLURM sends the stop signal (USR1) as the job starts, "
                  "so each run stops after its first batch. Give a longer --time or a smaller --signal-seconds "
                  f"(below {limit}, and enough for one batch).", file=sys.stderr)
        config.trainer.num_nodes, config.trainer.devices = res["nodes"], res["tasks_per_node"]
        output = config.writer.output_dir
        outputs = Outputs(output, config.writer.get("storage_options"))
        if outputs.folder is None:
            # one folder an output: array.json's submissions are of one prefix
            default_job_dir = Path.cwd() / JOBS_FOLDER / f"{job_name(args, config_path)}-{_url_tag(output)}"
        else:
            default_job_dir = Path(output).expanduser().resolve()
            outputs = Outputs(default_job_dir)
        job_dir = Path(args.job_dir).expanduser().resolve() if args.job_dir else default_job_dir
        raise_problems(script_value_problems(args, config_path, predict_args, output, job_dir)
                       + secret_problems(predict_args))
        if outputs.url is not None and (args.submit or args.array is not None):
            # the job's nodes reach the store as this machine does: same variables (sbatch passes them on)
            raise_problems(outputs.store.write_problems())
        expected = expected_images(config)
        if (args.array is not None or args.resubmit) and config.data.schedule == "pull":
            res["array"] = pool_array(args, expected)  # each task a job of the pool: no shards
        elif args.array is not None or args.resubmit:
            res["array"] = plan_array(args, config, outputs, job_dir, expected)
            if not res["array"]["shards"]:
                print("nothing to submit: every shard asked for is complete or still running.")
                return 0
            config.data.num_shards, config.data.shard_index = res["array"]["num_shards"], res["array"]["shards"][0]
        try:
            # predict's checks, on the config as the job runs it (on the cluster's GPUs)
            check_config(config, here=False)
        except ConfigError as err:
            if args.submit or not _only_not_cached(err):
                raise
            # A script rendered (or previewed) on a laptop without the weights or the network: the job checks
            # the model when it starts, and --submit fetches the weights before it submits.
            print(f"lightning-diffusion slurm: warning: the model was not checked here: {err}", file=sys.stderr)
        if args.submit:
            # The input is judged above, the environment here: only a job about to be submitted needs sbatch,
            # and before the weights are fetched or anything is written.
            _slurm_command("sbatch")
            if not args.no_download:  # after the checks: a job that cannot run fetches nothing
                res["weights"] = fetch_weights(config, str(config_path))
        if args.submit or args.script:
            if outputs.folder is not None:
                check_output_folder(outputs.folder, create=args.submit)
            if job_dir != outputs.folder:
                check_output_folder(job_dir, create=args.submit, what="the job folder (--job-dir)")
        text = render(args, config_path, predict_args, outputs, job_dir, res)
        script = Path(args.script).expanduser() if args.script else (job_dir / SCRIPT_NAME if args.submit else None)
        if script is None:
            print(text, end="")
            return 0
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(text)
        script.chmod(0o755)
        print(f"wrote {script}", flush=True)
        if not args.submit:
            return 0
        job_id = submit(script)
        if "array" in res and res["array"].get("pool"):
            print(f"submitted job {job_id}: an array of {res['array']['num_shards']} jobs of the pool writing "
                  f"{outputs.manifest}; logs: {job_dir}/slurm-{job_id}_<task>.out", flush=True)
            return wait_for_pool(job_id, outputs, expected) if args.wait else 0
        if "array" in res:
            record_array(job_dir, job_id, res["array"])
            shards = ",".join(str(t) for t in res["array"]["shards"])
            print(f"submitted job {job_id}: array of shards {shards} of {res['array']['num_shards']}; logs: "
                  f"{job_dir}/slurm-{job_id}_<shard>.out", flush=True)
            return wait_for_array(job_id, outputs, expected, res["array"], config) if args.wait else 0
        print(f"submitted job {job_id}; log: {job_dir}/slurm-{job_id}.out", flush=True)
        if not args.wait:
            return 0
        return wait_for(job_id, outputs, job_dir / f"slurm-{job_id}.out", expected)
    except ValueError as err:
        return report_config_error(err, "lightning-diffusion slurm")


def _only_not_cached(err: ConfigError) -> bool:
    """The one problem is a hub model this machine neither has nor can reach (the other checks passed)."""
    from lightning_diffusion.pipelines import hub

    text = str(err)
    return hub.NOT_CACHED in text and "problems:" not in text.splitlines()[0] and hub.offline()
