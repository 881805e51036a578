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
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from lightning_diffusion.output.store import store_class
from lightning_diffusion.run.config import read_config, report_config_error

RENDEZVOUS_PORT = 29500
DEFAULT_GRACE_SECONDS = 600


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="lightning-diffusion k8s", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Arguments after the known ones (e.g. --data.prompts /data/p.jsonl) are passed on to `predict`.")
    parser.add_argument("--config", required=True, help="the predict config (YAML), read here")
    parser.add_argument("--pod-config", help="where the pods find it (default: MOUNT/<its file name>; copy it there)")
    parser.add_argument("--image", required=True, help="a container image with this package installed")
    parser.add_argument("--nodes", type=int, help="pods (default: trainer.num_nodes, or 1)")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs a pod (default: trainer.devices)")
    parser.add_argument("--name", help="the job's name (default: lightning-diffusion-<config name>)")
    parser.add_argument("--namespace")
    parser.add_argument("--volume-claim", default="lightning-diffusion",
                        help="a ReadWriteMany PersistentVolumeClaim: outputs, prompts, the Hugging Face cache; "
                             "'none' with writer.output_dir in an object store (the config and prompts then come "
                             "with the image, the weights from the Hub)")
    parser.add_argument("--credentials-secret",
                        help="a Secret whose keys become the pods' environment (AWS_ACCESS_KEY_ID, "
                             "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL... for writer.output_dir s3://)")
    parser.add_argument("--mount", default="/data", help="where the pods mount it (default: /data)")
    parser.add_argument("--hf-home", help="the Hugging Face cache on the volume (default: MOUNT/huggingface)")
    parser.add_argument("--grace-seconds", type=int, default=DEFAULT_GRACE_SECONDS,
                        help="the pods' termination grace period: time to finish the images in flight")
    parser.add_argument("--max-restarts", type=int, default=3, help="torchrun restarts of the group")
    parser.add_argument("--cpus", help="CPU request of a pod, e.g. 32")
    parser.add_argument("--memory", help="memory request of a pod, e.g. 200Gi")
    parser.add_argument("--write", help="write the manifest here instead of printing it")
    return parser.parse_known_args(argv)


def job_name(args: argparse.Namespace) -> str:
    """A DNS-1123 label: lower case, digits and '-', at most 52 characters (the pods add -N-xxxxx)."""
    raw = args.name or f"lightning-diffusion-{Path(args.config).stem}"
    name = re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-")[:52].strip("-")
    return name or "lightning-diffusion"


def render(args: argparse.Namespace, predict_args: list[str], nodes: int, gpus: int) -> list[dict[str, Any]]:
    """The Service and the Job, as mappings (``yaml.safe_dump_all`` writes them). Without a volume
    (``--volume-claim none``), the pods read their config from the image and fetch the weights."""
    name = job_name(args)
    volume = args.volume_claim != "none"
    hf_home = args.hf_home or f"{args.mount.rstrip('/')}/huggingface"
    torchrun = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={gpus}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={name}-0.{name}:{RENDEZVOUS_PORT}", f"--rdzv-id={name}",
                f"--max-restarts={args.max_restarts}", "-m", "lightning_diffusion", "predict", "--config",
                args.pod_config or f"{args.mount.rstrip('/')}/{Path(args.config).name}",
                f"--trainer.num_nodes={nodes}", f"--trainer.devices={gpus}", *predict_args]
    metadata = {"name": name, "labels": {"app.kubernetes.io/name": "lightning-diffusion", "job-name": name}}
    if args.namespace:
        metadata["namespace"] = args.namespace
    resources: dict[str, Any] = {"limits": {"nvidia.com/gpu": gpus}}
    requests = {k: v for k, v in (("cpu", args.cpus), ("memory", args.memory)) if v}
    if requests:
        resources["requests"] = requests
    service = {"apiVersion": "v1", "kind": "Service", "metadata": metadata,
               "spec": {"clusterIP": "None", "selector": {"job-name": name},
                        "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT}]}}
    container = {
        "name": "predict", "image": args.image, "command": torchrun,  # PID 1: the pod's SIGTERM reaches torchrun
        "env": [*([{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "HF_HOME", "value": hf_home}] if volume else []),
                {"name": "OMP_NUM_THREADS", "value": "8"}],
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


def main(argv: list[str]) -> int:
    import yaml

    args, predict_args = parse_args(argv)
    try:
        # Parsed, not checked: its paths are the pods' (the volume), not this machine's.
        config = read_config(args.config, predict_args, check=False)
    except ValueError as err:
        return report_config_error(err, "lightning-diffusion k8s")
    nodes = args.nodes or int(config.trainer.get("num_nodes") or 1)
    devices = config.trainer.get("devices")
    gpus = args.gpus_per_node or (int(devices) if str(devices).isdigit() else 1)
    if nodes < 1 or gpus < 1:
        print("lightning-diffusion k8s: error: --nodes and --gpus-per-node must be at least 1.", file=sys.stderr)
        return 2
    output = str(config.writer.output_dir)
    if args.volume_claim == "none" and store_class(output).needs_shared_folder:
        print(f"lightning-diffusion k8s: error: --volume-claim none leaves the pods no shared folder, and "
              f"writer.output_dir {output} is one: write into an object store (s3://...) or give a claim.",
              file=sys.stderr)
        return 2
    if args.volume_claim == "none" and not args.pod_config:
        print("lightning-diffusion k8s: error: --volume-claim none: give --pod-config, where the image holds the "
              "config.", file=sys.stderr)
        return 2
    text = yaml.safe_dump_all(render(args, predict_args, nodes, gpus), sort_keys=False)
    if args.write:
        Path(args.write).write_text(text)
        print(f"wrote {args.write}: kubectl apply -f {args.write}")
    else:
        print(text, end="")
    return 0
