"""``lightning-diffusion slurm``: a config as a SLURM batch job that survives time limits and preemption.

    lightning-diffusion slurm --config X.yaml --nodes 4 --gpus-per-node 8 --time 04:00:00 [--submit [--wait]]
                              [-- --data.prompts p.jsonl ...]   (flags passed on to ``predict``)

The rendered script asks for what Lightning needs (one task per device: ``--ntasks-per-node`` =
``trainer.devices``, ``--nodes`` = ``trainer.num_nodes``, ``srun`` to start the tasks), checks that
every node sees the same output folder, and asks SLURM for ``SIGUSR1`` some minutes before the end.
On that signal the run finishes the images in flight, merges the manifest, and its global rank 0
requeues the job, which resumes from the manifest (see ``preemption``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from lightning_diffusion.config import check_config, read_config, report_config_error
from lightning_diffusion.preflight import build_strategy
from lightning_diffusion.errors import ConfigError

DEFAULT_SIGNAL_SECONDS = 300
DEFAULT_CPUS_PER_TASK = 8
SCRIPT_NAME = "lightning-diffusion.sbatch"
# Job states after which a job runs no more (scontrol's names).
FINAL_STATES = {
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "TIMEOUT",
}


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
    parser.add_argument("--script", help=f"write the script here (default with --submit: <output_dir>/{SCRIPT_NAME})")
    parser.add_argument("--submit", action="store_true", help="submit with sbatch and print the job id")
    parser.add_argument("--wait", action="store_true", help="with --submit: wait for the job and report how it ended")
    args, extra = parser.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    if args.wait and not args.submit:
        parser.error("--wait needs --submit")
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


def resources(trainer: Any, nodes: Optional[int], gpus_per_node: Optional[int],
              devices_per_process: int = 1) -> dict[str, Any]:
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
    tasks = devices if devices is not None else gpus_per_node // per
    return {"nodes": node_count, "tasks_per_node": tasks, "gpus_per_node": None if on_cpu else tasks * per}


def check_output_folder(output_dir: Path) -> None:
    """The folder (for the images and the job's log) can be created and written from here."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"cannot write the output folder {output_dir}: {err.strerror or err}.") from None


# ----------------------------------------------------------------------------- the script


def command_prefix() -> list[str]:
    """How the compute nodes start this installation: its own entry point, by absolute path."""
    entry = Path(sys.executable).parent / "lightning-diffusion"
    return [str(entry)] if entry.is_file() else [sys.executable, "-m", "lightning_diffusion"]


def render(
    args: argparse.Namespace, config_path: Path, predict_args: list[str], output_dir: Path, res: dict[str, Any]
) -> str:
    q = shlex.quote
    name = args.job_name or f"lightning-diffusion-{config_path.stem}"
    sbatch = [
        f"--job-name={name}",
        f"--nodes={res['nodes']}",
        f"--ntasks-per-node={res['tasks_per_node']}",
    ]
    if res["gpus_per_node"]:
        sbatch.append(f"--gpus-per-node={res['gpus_per_node']}")
    # Tokenizers, image encoding and NCCL's proxy thread need more than the 1 core a task gets
    # by default; a GPU job gets DEFAULT_CPUS_PER_TASK unless --cpus-per-task says otherwise.
    cpus = args.cpus_per_task if args.cpus_per_task is not None else (DEFAULT_CPUS_PER_TASK if res["gpus_per_node"] else None)
    if cpus is not None:
        sbatch.append(f"--cpus-per-task={cpus}")
    for flag in ("mem", "time", "partition", "account"):
        value = getattr(args, flag)
        if value is not None:
            sbatch.append(f"--{flag.replace('_', '-')}={value}")
    sbatch += [
        f"--signal=USR1@{args.signal_seconds}",
        "--requeue",
        "--open-mode=append",
        f"--chdir={Path.cwd()}",
        f"--output={output_dir}/slurm-%j.out",
        *args.extra_sbatch,
    ]
    predict = [
        *command_prefix(), "predict", "--config", str(config_path), *predict_args,
        "--trainer.num_nodes", str(res["nodes"]), "--trainer.devices", str(res["tasks_per_node"]),
    ]
    lines = [
        "#!/bin/bash",
        f"# Rendered by `lightning-diffusion slurm` from {config_path} on {datetime.date.today()}.",
        "# Edit the config and render again rather than editing this file.",
        *(f"#SBATCH {option}" for option in sbatch),
        "",
        "set -u",
        f"OUT={q(str(output_dir))}",
        'echo "lightning-diffusion: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, start $((${SLURM_RESTART_COUNT:-0} + 1))"',
        "",
        "# Every node must write into the same folder: the manifest is merged from all of them.",
        "srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "
        "'mkdir -p \"$1\" && : > \"$1/.node-check-$SLURM_JOB_ID-$SLURM_NODEID\"' _ \"$OUT\" || {",
        '    echo "lightning-diffusion: error: a node of $SLURM_JOB_NODELIST cannot create files in $OUT (see above)." >&2',
        "    exit 2",
        "}",
        "for _ in $(seq 60); do  # network filesystems may show other nodes' files after a delay",
        '    seen=$(ls "$OUT"/.node-check-"$SLURM_JOB_ID"-* 2>/dev/null | wc -l)',
        '    [ "$seen" -ge "$SLURM_JOB_NUM_NODES" ] && break',
        "    sleep 1",
        "done",
        'rm -f "$OUT"/.node-check-"$SLURM_JOB_ID"-*',
        'if [ "$seen" -lt "$SLURM_JOB_NUM_NODES" ]; then',
        '    echo "lightning-diffusion: error: $OUT is not one folder shared by the nodes: this node sees the files of'
        ' $seen of $SLURM_JOB_NUM_NODES. Put writer.output_dir on a shared filesystem, not node-local storage." >&2',
        "    exit 2",
        "fi",
        "",
        *(["# srun of Slurm 22.05-23.02 does not take --cpus-per-task from the allocation without this.",
           'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"'] if cpus is not None else []),
        # Every task sees all the node's GPUs and Lightning gives each its own (by local rank);
        # where a site binds one GPU per task by default, Lightning would find 1 of trainer.devices.
        f"srun --kill-on-bad-exit=1 {'--gpu-bind=none ' if res['gpus_per_node'] else ''}"
        f"{' '.join(q(word) for word in predict)} &",
        "step=$!",
        "# A signal sent to this shell only (scancel --signal=USR1 --batch) goes on to the tasks. On the",
        "# signal they finish the images in flight, merge the manifest and rank 0 requeues this job.",
        "trap 'kill -USR1 $step 2>/dev/null' USR1",
        "while :; do",
        "    wait $step",
        "    rc=$?",
        "    kill -0 $step 2>/dev/null || break  # still running: the wait was cut short by the trap",
        "done",
        "exit $rc",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- sbatch and scontrol


def _slurm_command(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ConfigError(
            f"{name} is not installed here (not on PATH). Run this on the cluster's login node, or write the "
            "script with --script FILE (without --submit) and submit it there with sbatch."
        )
    return path


def submit(script: Path) -> str:
    proc = subprocess.run([_slurm_command("sbatch"), "--parsable", str(script)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ConfigError(f"sbatch refused the job: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip().split(";")[0]


def job_fields(job_id: str) -> Optional[dict[str, str]]:
    """``scontrol show job`` as a dict; None once SLURM has forgotten the job."""
    proc = subprocess.run(
        [_slurm_command("scontrol"), "show", "job", "-o", job_id], capture_output=True, text=True
    )
    if proc.returncode != 0 or "=" not in proc.stdout:
        return None
    fields = {}
    for word in proc.stdout.split():
        key, sep, value = word.partition("=")
        if sep:
            fields[key] = value
    return fields


def count_done(output_dir: Path) -> int:
    from lightning_diffusion.manifest import read_manifest

    return len(read_manifest(output_dir)) if output_dir.is_dir() else 0


def wait_for(job_id: str, output_dir: Path, expected: Optional[int], poll_s: float = 2.0) -> int:
    """Follow the job until it ends; report its state, starts and the images in the manifest."""
    last_state, fields = None, None
    while True:
        current = job_fields(job_id)
        if current is None:
            break
        fields = current
        state = fields.get("JobState")
        if state != last_state:
            print(f"job {job_id}: {state} (restarts: {fields.get('Restarts', '0')})", flush=True)
            last_state = state
        if state in FINAL_STATES:
            break
        time.sleep(poll_s)
    done = count_done(output_dir)
    total = f" of {expected}" if expected is not None else ""
    print(f"job {job_id}: {last_state or 'gone'}, exit code {(fields or {}).get('ExitCode', '?')}; "
          f"{done}{total} outputs in {output_dir / 'manifest.jsonl'}; log: {output_dir}/slurm-{job_id}.out")
    complete = expected is not None and done >= expected
    return 0 if last_state == "COMPLETED" or (last_state is None and complete) else 1


# ----------------------------------------------------------------------------- entry point


def main(argv: list[str]) -> int:
    args, predict_args = parse_args(argv)
    try:
        config_path = Path(args.config).expanduser().resolve()
        if not config_path.is_file():
            raise ConfigError(f"no config file at {args.config}.")
        # One parse; the checks run once the job's node and device counts are known.
        config = read_config(str(config_path), predict_args, check=False)
        strategy = build_strategy(config.trainer.get("strategy"))
        res = resources(config.trainer, args.nodes, args.gpus_per_node, getattr(strategy, "devices_per_process", 1))
        if args.submit:
            _slurm_command("sbatch")  # before the checks below, which take seconds
        if args.signal_seconds < 1:
            raise ConfigError(f"--signal-seconds must be >= 1, got {args.signal_seconds}.")
        config.trainer.num_nodes, config.trainer.devices = res["nodes"], res["tasks_per_node"]
        check_config(config)  # predict's own weight-free checks, on the config as the job runs it
        output_dir = Path(config.writer.output_dir).expanduser().resolve()
        if args.submit or args.script:
            check_output_folder(output_dir)
        text = render(args, config_path, predict_args, output_dir, res)
        script = Path(args.script).expanduser() if args.script else (output_dir / SCRIPT_NAME if args.submit else None)
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
        print(f"submitted job {job_id}; log: {output_dir}/slurm-{job_id}.out", flush=True)
        if not args.wait:
            return 0
        from lightning_diffusion.data import load_records

        expected = len(load_records(config.data.prompts)) * int(config.data.num_images_per_prompt)
        return wait_for(job_id, output_dir, expected)
    except ValueError as err:
        return report_config_error(err, "lightning-diffusion slurm")

