"""``lightning-diffusion k8s`` renders a Service and an Indexed Job from a config (no cluster here:
the rendered objects are parsed and checked field by field)."""

import pytest
import yaml

from lightning_diffusion.commands.k8s import main


def render(capsys, *argv):
    assert main(list(argv)) == 0
    return list(yaml.safe_load_all(capsys.readouterr().out))


def test_the_manifest_runs_one_torchrun_agent_a_pod_over_a_shared_volume(capsys):
    service, job = render(capsys, "--config", "configs/flux-dev-dp8.yaml", "--image", "registry/ld:1.0", "--nodes", "4",
                          "--grace-seconds", "900", "--data.prompts", "/data/prompts.jsonl")
    name = "lightning-diffusion-flux-dev-dp8"
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": name}
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 4
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == name and pod["terminationGracePeriodSeconds"] == 900
    (container,) = pod["containers"]
    assert container["image"] == "registry/ld:1.0"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8  # the config's trainer.devices
    command = container["command"]
    assert command[:3] == ["torchrun", "--nnodes=4", "--nproc-per-node=8"]
    assert f"--rdzv-endpoint={name}-0.{name}:29500" in command
    assert command[command.index("predict") + 1:command.index("predict") + 3] == ["--config", "/data/flux-dev-dp8.yaml"]
    assert "--trainer.num_nodes=4" in command and command[-2:] == ["--data.prompts", "/data/prompts.jsonl"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"] == "/data/huggingface"
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "lightning-diffusion"}} in pod["volumes"]


def test_a_bad_config_is_refused_and_gpus_follow_the_flag(capsys, tmp_path):
    with pytest.raises(SystemExit) as refused:  # the parser's one-line refusal
        main(["--config", "configs/tiny.yaml", "--image", "x", "--data.batch_size", "zero"])
    assert refused.value.code == 2 and "data.batch_size: expected int" in capsys.readouterr().err
    _, job = render(capsys, "--config", "configs/tiny.yaml", "--image", "x", "--gpus-per-node", "2",
                    "--name", "My_Run.v2", "--pod-config", "/cfg/run.yaml", "--trainer.accelerator", "gpu")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert job["metadata"]["name"] == "my-run-v2" and container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert "/cfg/run.yaml" in container["command"] and "--nproc-per-node=2" in container["command"]


def test_an_object_store_run_needs_no_shared_volume_only_its_credentials(capsys):
    _, job = render(capsys, "--config", "configs/tiny-flux.yaml", "--image", "x", "--nodes", "2",
                    "--volume-claim", "none", "--pod-config", "/app/run.yaml", "--credentials-secret", "s3-creds",
                    "--writer.output_dir", "s3://images/run1", "--writer.format", "webdataset")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["volumes"] == [{"name": "shm", "emptyDir": {"medium": "Memory"}}]
    assert container["volumeMounts"] == [{"name": "shm", "mountPath": "/dev/shm"}]
    assert container["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert "HF_HUB_OFFLINE" not in {e["name"] for e in container["env"]}  # no cache volume: the weights are fetched
    assert container["command"][-4:] == ["--writer.output_dir", "s3://images/run1", "--writer.format", "webdataset"]
    assert main(["--config", "configs/tiny-flux.yaml", "--image", "x", "--volume-claim", "none",
                 "--pod-config", "/app/run.yaml"]) == 2
    assert "writer.output_dir outputs/tiny-flux is one: write into an object store" in capsys.readouterr().err


def test_a_cpu_config_asks_for_cpus_only_and_its_threads_follow_the_request(capsys):
    """configs/tiny.yaml runs on CPU: no GPU resource, a CPU request (8 cores a process by default),
    OMP_NUM_THREADS the request shared by the pod's processes; a GPU config's threads follow --cpus too."""
    _, job = render(capsys, "--config", "configs/tiny.yaml", "--image", "x")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["resources"] == {"requests": {"cpu": "8"}}
    assert "nvidia.com/gpu" not in yaml.safe_dump(job)
    assert {"name": "OMP_NUM_THREADS", "value": "8"} in container["env"]
    assert container["command"][:3] == ["torchrun", "--nnodes=1", "--nproc-per-node=1"]
    for cpus, processes, expected in (("4", "2", "2"), ("500m", "1", "1"), ("3", "2", "1"), ("16", "1", "16")):
        _, job = render(capsys, "--config", "configs/tiny.yaml", "--image", "x", "--cpus", cpus,
                        "--trainer.devices", processes)
        (container,) = job["spec"]["template"]["spec"]["containers"]
        assert container["resources"] == {"requests": {"cpu": cpus}}, cpus
        assert {"name": "OMP_NUM_THREADS", "value": expected} in container["env"], (cpus, processes)
        assert f"--nproc-per-node={processes}" in container["command"]
    _, job = render(capsys, "--config", "configs/flux-dev-dp8.yaml", "--image", "x", "--cpus", "32",
                    "--memory", "200Gi")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}, "requests": {"cpu": "32", "memory": "200Gi"}}
    assert {"name": "OMP_NUM_THREADS", "value": "4"} in container["env"]  # 32 cores over 8 processes
    assert main(["--config", "configs/tiny.yaml", "--image", "x", "--gpus-per-node", "2"]) == 2
    captured = capsys.readouterr()
    assert "the config runs on CPU (trainer.accelerator: cpu) but --gpus-per-node asks for GPUs" in captured.err
    assert captured.out == ""


def test_a_relative_output_folder_is_placed_on_the_volume_and_one_off_it_is_refused(capsys):
    def command(*argv):
        _, job = render(capsys, "--config", "configs/tiny.yaml", "--image", "x", *argv)
        return job["spec"]["template"]["spec"]["containers"][0]["command"]

    words = command()  # the config's writer.output_dir: outputs/tiny
    assert words[-2:] == ["--writer.output_dir", "/data/outputs/tiny"]
    words = command("--mount", "/mnt/shared", "--writer.output_dir=runs/a", "--data.batch_size", "2")
    assert words[-3:] == ["--writer.output_dir=/mnt/shared/runs/a", "--data.batch_size", "2"]
    _, job = render(capsys, "--config", "configs/tiny.yaml", "--image", "x", "--writer.output_dir", "/data/runs/b")
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][-2:] == ["--writer.output_dir", "/data/runs/b"]
    assert main(["--config", "configs/tiny.yaml", "--image", "x", "--write", "/dev/null"]) == 0
    assert "writer.output_dir outputs/tiny is relative: the pods write it on the volume, at /data/outputs/tiny" in (
        capsys.readouterr().err)
    for output, message in (("/scratch/out", "writer.output_dir /scratch/out is not on the volume mounted at /data"),
                            ("../out", "(placed under it: /out)"),
                            ("~/out", "writer.output_dir ~/out names a home folder")):
        assert main(["--config", "configs/tiny.yaml", "--image", "x", "--writer.output_dir", output]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and message in captured.err, captured.err
        assert "e.g. --writer.output_dir /data/outputs" in captured.err and len(captured.err.splitlines()) == 1


@pytest.mark.parametrize("flag, values", [
    ("--namespace", ["team a", "team\na", "$(id)", "équipe", "n" * 64, "Team", "-team", "a.b"]),
    ("--volume-claim", ["shared data", "data\n", "$(id)", "dätä", "d" * 254, "Data", "data-"]),
    ("--credentials-secret", ["s3 creds", "s3\ncreds", "$(cat /etc/passwd)", "clés", "s" * 254, "S3"]),
    ("--image", ["registry/ld 1.0", "registry/ld:1.0\n", "$(id)", "régistry/ld", "registry/Team/ld", "ld:", "ld:1 0"]),
    ("--mount", ["data", "/da ta", "/data\n", "/$(id)", "/dätä", "/a/../b", "/data:ro"]),
    ("--hf-home", ["huggingface", "/data/hf cache"]),
    ("--cpus", ["many", "4 cores", "-1"]),
    ("--memory", ["lots", "200 Gi"]),
    ("--grace-seconds", ["-1"]),
])
def test_a_flag_kubernetes_would_refuse_is_refused_in_one_line(capsys, flag, values):
    for value in values:
        argv = ["--config", "configs/flux-dev-dp8.yaml", "--image", "registry/ld:1.0", f"{flag}={value}"]
        assert main(argv) == 2, (flag, value)
        captured = capsys.readouterr()
        assert captured.out == ""
        (line,) = captured.err.splitlines()
        assert line.startswith(f"lightning-diffusion k8s: error: {flag} {value!r} is not ") or (
            line == f"lightning-diffusion k8s: error: {flag} must be 0 or more, got {value}."), line


def test_valid_names_images_and_paths_are_passed_as_given_and_no_word_is_expanded(capsys):
    image = "registry.example.com:5000/team/lightning-diffusion:1.0-cuda12@sha256:" + "a" * 64
    service, job = render(capsys, "--config", "configs/flux-dev-dp8.yaml", "--image", image,
                          "--namespace", "t" * 63, "--volume-claim", "shared.data-1",
                          "--credentials-secret", "s3-creds",
                          "--mount", "/mnt/shared_data-1", "--name", "2nd run", "--data.prompts", "/mnt/p$(HOME).jsonl")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == image and service["metadata"]["namespace"] == "t" * 63
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "shared.data-1"}} in pod["volumes"]
    assert job["metadata"]["name"] == "ld-2nd-run"  # a Service's name begins with a letter
    # Kubernetes expands $(NAME) in a container's command; $$ is its literal $
    assert container["command"][-2:] == ["--data.prompts", "/mnt/p$$(HOME).jsonl"]
    for image in ("x", "ubuntu", "localhost:5000/a/b", "nvcr.io/nvidia/pytorch:24.01-py3", "a__b/c.d-e:latest"):
        assert render(capsys, "--config", "configs/flux-dev-dp8.yaml", "--image", image)[1]["spec"]["template"][
            "spec"]["containers"][0]["image"] == image
