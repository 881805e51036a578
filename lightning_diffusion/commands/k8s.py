"""``lightning-diffusion k8s``: a config as a Kubernetes job of ``torchrun`` nodes.

    lightning-diffusion k8s --config X.yaml --image registry/team/lightning-diffusion:1.0 [--nodes N]
        [--gpus-per-node G] [--volume-claim outputs] [--mount /data] [--grace-seconds 600]
        [--write job.yaml] [-- --data.prompts /data/prompts.jsonl ...]   (flags passed on to ``predict``)

It renders two objects of core Kubernetes, no operator needed (Kubeflow's PyTorchJob needs the
training operator, JobSet its own controller): a headless ``Service`` that gives each pod a DNS
name, and an *Indexed* ``Job`` of ``--nodes`` pods that run at once, one ``torchrun`` agent each
(``--nproc-per-node`` = the GPUs of a pod), meeting at a c10d rendezvous on pod 0. The pods mount
one shared volume (a ReadWriteMany claim: the output folder, the prompt files and the Hugging Face
cache, which ``lightning-diffusion download`` fills beforehand) and run with ``HF_HUB_OFFLINE=1``.

Deleting a pod (or the cluster preempting it) sends SIGTERM: the run finishes the images in
flight and merges its manifest within ``--grace-seconds`` (the pod's termination grace period).
A lost worker or pod makes ``torchrun`` restart the group (``--max-restarts``, and the Job's
``backoffLimit`` for whole pods), and the restarted run resumes from the manifest.

A pod asks for what the config runs on: ``nvidia.com/gpu`` for a GPU config, only CPUs for a CPU
config (``trainer.accelerator: cpu``), and ``OMP_NUM_THREADS`` is its CPU request shared by its
processes. A relative ``writer.output_dir`` is placed on the volume (``MOUNT/<it>``).
"""

from __future__ import annotations

import argparse
import math
import posixpath
import re
import sys
from pathlib import Path
from typing import Any, Optional

from lightning_diffusion.commands import help_text
from lightning_diffusion.output.store import store_class
from lightning_diffusion.run.config import read_config, report_config_error

RENDEZVOUS_PORT = 29500
DEFAULT_GRACE_SECONDS = 600
# CPU threads a process (OMP_NUM_THREADS) without --cpus; a CPU config also asks for that many cores a process.
DEFAULT_CPUS_PER_PROCESS = 8

# Names as Kubernetes validates them: a DNS-1123 label (namespaces) and subdomain (claims, secrets).
_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
DNS_LABEL = re.compile(_LABEL)
DNS_SUBDOMAIN = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
# An image reference as the container runtimes parse it: [host[:port]/]path[:tag][@algorithm:hex].
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*|\[[0-9a-fA-F:]+\])"
IMAGE = re.compile(rf"(?P<name>(?:{_HOST}(?::[0-9]+)?/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
                   r"(?::\w[\w.-]{0,127})?(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?",
                   re.ASCII)
# A path in the pod: absolute, of letters, digits and ._-+@%=, (no spaces, quotes, '$' or ':').
POD_PATH = re.compile(r"/[A-Za-z0-9._+@%=,/-]*", re.ASCII)
# Kubernetes quantities: CPUs (32, 0.5, 500m) and bytes (200Gi, 64G, 1e9).
CPU_QUANTITY = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)m?", re.ASCII)
MEMORY_QUANTITY = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[KMGTPE]i|[kMGTPE]|m|[eE][+-]?\d+)?", re.ASCII)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="lightning-diffusion k8s", description=help_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Arguments after the known ones (e.g. --data.prompts /data/p.jsonl) are passed on to `predict`.")
    parser.add_argument("--config", required=True, help="the predict config (YAML), read here")
    parser.add_argument("--pod-config", help="where the pods find it (default: MOUNT/<its file name>; copy it there)")
    parser.add_argument("--image", required=True, help="a container image with this package installed")
    parser.add_argument("--nodes", type=int, help="pods (default: trainer.num_nodes, or 1)")
    parser.add_argument("--gpus-per-node", type=int,
                        help="GPUs a pod (default: trainer.devices); a CPU config's pods ask for no GPU")
    parser.add_argument("--name", help="the job's name (default: lightning-diffusion-<config name>)")
    parser.add_argument("--namespace", help="the namespace of the Service and the Job (default: kubectl's)")
    parser.add_argument("--volume-claim", default="lightning-diffusion",
                        help="a ReadWriteMany PersistentVolumeClaim: outputs, prompts, the Hugging Face cache; "
                             "'none' with writer.output_dir in an object store (the config and prompts then come "
                             "with the image, the weights from the Hub)")
    parser.add_argument("--credentials-secret",
                        help="a Secret whose keys become the pods' environment (AWS_ACCESS_KEY_ID, "
                             "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL... for writer.output_dir s3://)")
    parser.add_argument("--mount", default="/data", help="where the pods mount it, an absolute path (default: /data); "
                        "a relative writer.output_dir is placed under it")
    parser.add_argument("--hf-home", help="the Hugging Face cache on the volume (default: MOUNT/huggingface)")
    parser.add_argument("--grace-seconds", type=int, default=DEFAULT_GRACE_SECONDS,
                        help="the pods' termination grace period: time to finish the images in flight")
    parser.add_argument("--max-restarts", type=int, default=3, help="torchrun restarts of the group")
    parser.add_argument("--cpus", help="CPU request of a pod, e.g. 32 (default: none for a GPU config, "
                        f"{DEFAULT_CPUS_PER_PROCESS} a process for a CPU config); OMP_NUM_THREADS is it shared by "
                        f"the pod's processes ({DEFAULT_CPUS_PER_PROCESS} without it)")
    parser.add_argument("--memory", help="memory request of a pod, e.g. 200Gi")
    parser.add_argument("--write", help="write the manifest here instead of printing it")
    return parser.parse_known_args(argv)


def job_name(args: argparse.Namespace) -> str:
    """A DNS-1035 label (the Service's name): lower case, digits and '-', beginning with a letter, at
    most 52 characters (the pods add -N-xxxxx)."""
    raw = args.name or f"lightning-diffusion-{Path(args.config).stem}"
    name = re.sub(r"[^a-z0-9-]+", "-", raw.lower(), flags=re.ASCII).strip("-")
    if name and not name[0].isalpha():
        name = f"ld-{name}"
    return name[:52].strip("-") or "lightning-diffusion"


def flag_problems(args: argparse.Namespace) -> list[str]:
    """The flags that Kubernetes would refuse, or that would not mean in the pod what they say here:
    one line each."""
    problems = []
    label = ("a DNS-1123 label: at most 63 characters, lower-case letters, digits and '-', beginning and "
             "ending with a letter or digit")
    subdomain = ("a DNS-1123 subdomain: at most 253 characters, lower-case letters, digits, '-' and '.', "
                 "beginning and ending with a letter or digit")
    names = [("--namespace", args.namespace, "a namespace's name", DNS_LABEL, 63, label, "team-a"),
             ("--volume-claim", None if args.volume_claim == "none" else args.volume_claim,
              "a PersistentVolumeClaim's name (or none)", DNS_SUBDOMAIN, 253, subdomain, "shared-data"),
             ("--credentials-secret", args.credentials_secret, "a Secret's name", DNS_SUBDOMAIN, 253, subdomain,
              "s3-creds")]
    for flag, value, what, pattern, longest, rule, example in names:
        if value is not None and (len(value) > longest or not pattern.fullmatch(value)):
            problems.append(f"{flag} {value!r} is not {what}, {rule} (e.g. {example}).")
    image = IMAGE.fullmatch(args.image) if len(args.image) <= 1024 else None
    if image is None or len(image["name"]) > 255:
        problems.append(f"--image {args.image!r} is not an image reference such as "
                        "registry.example.com/team/lightning-diffusion:1.0 ([host[:port]/]path[:tag][@sha256:digest]: "
                        "a lower-case path, no spaces).")
    for flag, value in (("--mount", args.mount), ("--hf-home", args.hf_home)):
        if value is not None and (not POD_PATH.fullmatch(value) or ".." in value.split("/")):
            problems.append(f"{flag} {value!r} is not an absolute path in the pod such as /data (a '/', then "
                            "letters, digits and ._-+@%=,/; no spaces, quotes, '$', ':' or '..').")
    if args.cpus is not None and not CPU_QUANTITY.fullmatch(args.cpus):
        problems.append(f"--cpus {args.cpus!r} is not a CPU quantity such as 32, 0.5 or 500m.")
    elif args.cpus is not None and cpu_cores(args.cpus) <= 0:
        problems.append(f"--cpus {args.cpus!r} asks for no CPU: give at least 1m.")
    if args.memory is not None and not MEMORY_QUANTITY.fullmatch(args.memory):
        problems.append(f"--memory {args.memory!r} is not a memory quantity such as 200Gi or 64G.")
    for flag, number in (("--grace-seconds", args.grace_seconds), ("--max-restarts", args.max_restarts)):
        if number < 0:
            problems.append(f"{flag} must be 0 or more, got {number}.")
    return problems


def cpu_cores(quantity: str) -> float:
    """A CPU quantity (``32``, ``0.5``, ``500m``) in cores."""
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def threads(cpus: Optional[str], processes: int) -> int:
    """OMP_NUM_THREADS of each of a pod's processes: its CPU request shared among them (at least 1)."""
    if cpus is None:
        return DEFAULT_CPUS_PER_PROCESS
    return max(1, math.floor(cpu_cores(cpus) / processes))


def pod_output(output: str, mount: str) -> tuple[Optional[str], Optional[str]]:
    """Where the pods write a folder ``writer.output_dir`` (on the volume), or why they cannot: (the
    folder in the pod, None) or (None, the problem)."""
    mount = posixpath.normpath(mount)
    placed = posixpath.normpath(output if posixpath.isabs(output) else posixpath.join(mount, output))
    if output.startswith("~"):
        return None, (f"writer.output_dir {output} names a home folder, which in the pod is inside its container: "
                      f"give a folder on the volume, e.g. --writer.output_dir {posixpath.join(mount, 'outputs')}.")
    if mount != "/" and placed != mount and not placed.startswith(mount + "/"):
        where = "" if posixpath.isabs(output) else f" (placed under it: {placed})"
        return None, (f"writer.output_dir {output} is not on the volume mounted at {mount}{where}: the pods would "
                      "write it inside their containers, and lose it as they end. Give a folder on the volume, e.g. "
                      f"--writer.output_dir {posixpath.join(mount, 'outputs', posixpath.basename(placed) or 'run')}.")
    return placed, None


def with_output(predict_args: list[str], folder: str) -> list[str]:
    """``predict_args`` that set ``writer.output_dir`` to ``folder``: its value replaced where the
    arguments give it, else the flag added (first, unless they set the writer another way)."""
    args = list(predict_args)
    for i, word in enumerate(args):
        if word == "--writer.output_dir" and i + 1 < len(args):
            args[i + 1] = folder
            return args
        if word.startswith("--writer.output_dir="):
            args[i] = f"--writer.output_dir={folder}"
            return args
    if any(word.startswith("--writer") for word in args):
        return [*args, "--writer.output_dir", folder]
    return ["--writer.output_dir", folder, *args]


def literal(word: str) -> str:
    """``word`` as Kubernetes passes it on: it expands ``$(NAME)`` in a container's command and
    environment values, and reads ``$$`` as ``$``."""
    return word.replace("$", "$$")


def render(args: argparse.Namespace, predict_args: list[str], nodes: int, processes: int,
           on_cpu: bool = False) -> list[dict[str, Any]]:
    """The Service and the Job, as mappings (``yaml.safe_dump_all`` writes them): ``processes``
    torchrun workers a pod, each on a GPU of its own, or on CPUs only (``on_cpu``). Without a volume
    (``--volume-claim none``), the pods read their config from the image and fetch the weights."""
    name = job_name(args)
    volume = args.volume_claim != "none"
    hf_home = args.hf_home or f"{args.mount.rstrip('/')}/huggingface"
    torchrun = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={processes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={name}-0.{name}:{RENDEZVOUS_PORT}", f"--rdzv-id={name}",
                f"--max-restarts={args.max_restarts}", "-m", "lightning_diffusion", "predict", "--config",
                args.pod_config or f"{args.mount.rstrip('/')}/{Path(args.config).name}",
                f"--trainer.num_nodes={nodes}", f"--trainer.devices={processes}", *predict_args]
    metadata = {"name": name, "labels": {"app.kubernetes.io/name": "lightning-diffusion", "job-name": name}}
    if args.namespace:
        metadata["namespace"] = args.namespace
    resources: dict[str, Any] = {} if on_cpu else {"limits": {"nvidia.com/gpu": processes}}
    cpus = args.cpus or (str(DEFAULT_CPUS_PER_PROCESS * processes) if on_cpu else None)
    requests = {k: v for k, v in (("cpu", cpus), ("memory", args.memory)) if v}
    if requests:
        resources["requests"] = requests
    service = {"apiVersion": "v1", "kind": "Service", "metadata": metadata,
               "spec": {"clusterIP": "None", "selector": {"job-name": name},
                        "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT}]}}
    container = {
        # PID 1: the pod's SIGTERM reaches torchrun. Its words are passed as they are ($ is not expanded).
        "name": "predict", "image": args.image, "command": [literal(word) for word in torchrun],
        "env": [*([{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "HF_HOME", "value": literal(hf_home)}]
                  if volume else []),
                {"name": "OMP_NUM_THREADS", "value": str(threads(cpus, processes))}],
        **({"envFrom": [{"secretRef": {"name": args.credentials_secret}}]} if args.credentials_secret else {}),
        "resources": resources,
        "ports": [{"containerPort": RENDEZVOUS_PORT, "name": "rendezvous"}],
        "volumeMounts": [*([{"name": "data", "mountPath": args.mount}] if volume else []),
                         {"name": "shm", "mountPath": "/dev/shm"}],
    }
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": {
        "completionMode": "Indexed", "completions": nodes, "parallelism": nodes, "backoffLimit": args.max_restarts,
        "template": {"metadata": {"labels": {"job-name": name}}, "spec": {
            "subdomain": name,  # pod N is <name>-N.<name>: pod 0 holds the rendezvous
            "restartPolicy": "OnFailure",
            "terminationGracePeriodSeconds": args.grace_seconds,
            "containers": [container],
            "volumes": [*([{"name": "data", "persistentVolumeClaim": {"claimName": args.volume_claim}}]
                          if volume else []), {"name": "shm", "emptyDir": {"medium": "Memory"}}],
        }},
    }}
    return [service, job]


def fail(message: str) -> int:
    print(f"lightning-diffusion k8s: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    import yaml

    args, predict_args = parse_args(argv)
    problems = flag_problems(args)
    if problems:
        for problem in problems:
            fail(problem)
        return 2
    try:
        # Parsed, not checked: its paths are the pods' (the volume), not this machine's.
        config = read_config(args.config, predict_args, check=False)
    except ValueError as err:
        return report_config_error(err, "lightning-diffusion k8s")
    nodes = args.nodes or int(config.trainer.get("num_nodes") or 1)
    devices = config.trainer.get("devices")
    on_cpu = str(config.trainer.get("accelerator") or "auto").lower() == "cpu"
    if on_cpu and args.gpus_per_node is not None:
        return fail("the config runs on CPU (trainer.accelerator: cpu) but --gpus-per-node asks for GPUs; drop "
                    "--gpus-per-node (trainer.devices is the processes of a pod), or set trainer.accelerator: gpu.")
    processes = args.gpus_per_node or (int(devices) if str(devices).isdigit() else 1)
    if nodes < 1 or processes < 1:
        return fail("--nodes and --gpus-per-node (or trainer.devices) must be at least 1.")
    output = str(config.writer.output_dir)
    folder = store_class(output).is_folder
    if args.volume_claim == "none" and folder:
        return fail(f"--volume-claim none leaves the pods no shared folder, and writer.output_dir {output} is one: "
                    "write into an object store (s3://...) or give a claim.")
    if args.volume_claim == "none" and not args.pod_config:
        return fail("--volume-claim none: give --pod-config, where the image holds the config.")
    if folder:
        placed, refusal = pod_output(output, args.mount)
        if refusal is not None:
            return fail(refusal)
        assert placed is not None
        if not posixpath.isabs(output):
            print(f"lightning-diffusion k8s: writer.output_dir {output} is relative: the pods write it on the "
                  f"volume, at {placed}.", file=sys.stderr)
            predict_args = with_output(predict_args, placed)
    text = yaml.safe_dump_all(render(args, predict_args, nodes, processes, on_cpu), sort_keys=False)
    if args.write:
        Path(args.write).write_text(text)
        print(f"wrote {args.write}: kubectl apply -f {args.write}")
    else:
        print(text, end="")
    return 0
