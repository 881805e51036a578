# The weights were fetched on the login node: the nodes read them from that cache and never touch the network.
export HF_HUB_CACHE=@CACHE@
export HF_HUB_OFFLINE=1
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c 'test -f "$1/model_index.json" || {
    echo "lightning-diffusion: error: node $SLURMD_NODENAME does not see the weights of @REPO@ in $1: the Hugging Face cache must be on a file system the nodes share (set HF_HOME to one, then submit again)." >&2
    exit 2
}' _ @SNAPSHOT@ || exit 2

