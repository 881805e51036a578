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
                    "--name", "My_Run.v2", "--pod-config", "/cfg/run.yaml")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert job["metadata"]["name"] == "my-run-v2" and container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert "/cfg/run.yaml" in container["command"]


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
