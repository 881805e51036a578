OUT=@OUT@
# Every node must write into the same folder: the manifest is merged from all of them.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c 'mkdir -p "$1" && : > "$1/.node-check-$SLURM_JOB_ID-$SLURM_NODEID"' _ "$OUT" || {
    echo "lightning-diffusion: error: a node of $SLURM_JOB_NODELIST cannot create files in $OUT (see above)." >&2
    exit 2
}
for _ in $(seq 60); do  # network filesystems may show other nodes' files after a delay
    seen=$(ls "$OUT"/.node-check-"$SLURM_JOB_ID"-* 2>/dev/null | wc -l)
    [ "$seen" -ge "$SLURM_JOB_NUM_NODES" ] && break
    sleep 1
done
rm -f "$OUT"/.node-check-"$SLURM_JOB_ID"-*
if [ "$seen" -lt "$SLURM_JOB_NUM_NODES" ]; then
    echo "lightning-diffusion: error: $OUT is not one folder shared by the nodes: this node sees the files of $seen of $SLURM_JOB_NUM_NODES. Put writer.output_dir on a shared filesystem, not node-local storage." >&2
    exit 2
fi
