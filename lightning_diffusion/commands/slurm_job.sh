#!/bin/bash
# Rendered by `lightning-diffusion slurm` from @CONFIG@ on @DATE@.
# Edit the config and render again rather than editing this file.
@SBATCH@

set -u
echo "lightning-diffusion: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, start $((${SLURM_RESTART_COUNT:-0} + 1))@ARRAY_NOTE@"

@SHARED_FOLDER@
@WEIGHTS@
@CPUS@
srun --kill-on-bad-exit=1 @GPU_BIND@@PREDICT@@SHARD_FLAGS@ &
step=$!
# A signal sent to this shell only (scancel --signal=USR1 --batch) goes on to the tasks. On the
# signal they finish the images in flight, merge the manifest and rank 0 requeues this job.
trap 'kill -USR1 $step 2>/dev/null' USR1
while :; do
    wait $step
    rc=$?
    kill -0 $step 2>/dev/null || break  # still running: the wait was cut short by the trap
done
exit $rc
